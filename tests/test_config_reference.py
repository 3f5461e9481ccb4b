"""The configuration reference page, written from the typed config tree (tools/config_reference.py)."""

import dataclasses
import typing

from controller.config import RLConfig
from controller.sft.config import SFTConfig
from tools.config_reference import _field_comments, _problems, render


def keys(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = f"{prefix}.{field.name}" if prefix else field.name
        yield key
        section = next((a for a in (typing.get_args(hints[field.name]) or (hints[field.name],))
                        if dataclasses.is_dataclass(a) and isinstance(a, type)), None)
        if section is not None:
            yield from keys(section, key)


def test_every_key_of_both_trees_is_on_the_page_with_its_type_and_default():
    page = render()
    rl, sft = page.split("## SFT jobs")
    for tree, text in ((RLConfig, rl), (SFTConfig, sft)):
        for key in keys(tree):
            assert f"| `{key}` |" in text, key
    assert "| `trainer.max_staleness` | int | `1` | samples more updates stale than this are not trained on" in rl
    assert "| `reward.fn` | str \\| function \\| null | `'auto'` |" in rl


def test_a_keys_checks_are_read_from_the_checks_source():
    page = render()
    assert "- `trainer.max_staleness`: trainer.max_staleness must be >= 0, got …" in page
    assert "- `data.batch_size`: data.batch_size must be >= 1, got …" in page.split("## SFT jobs")[0]
    # a section's own __post_init__ checks are listed under the field they name
    assert "- `rollout.truncation`: " in page


def test_comments_and_problems_are_parsed_from_source():
    @dataclasses.dataclass
    class Section:
        # the first line
        # and the second
        alpha: int = 1  # trailing
        beta: str = "x"

    assert _field_comments(Section) == {"alpha": "the first line and the second trailing", "beta": ""}
    source = 'problems.append(f"x.alpha must be >= 1, got {value!r}")\nraise ValueError("x.beta is not right here")\n'
    assert _problems(source) == ["x.alpha must be >= 1, got …", "x.beta is not right here"]


def test_the_committed_page_is_the_generated_one():
    """docs/reference/configuration.md is committed (readable in the repository) and rewritten by every docs
    build; a config change without `make docs` (or `python tools/config_reference.py > ...`) fails here."""
    from conftest import ROOT

    assert (ROOT / "docs" / "reference" / "configuration.md").read_text() == render(), (
        "docs/reference/configuration.md is stale: run `make docs` (or python tools/config_reference.py "
        "> docs/reference/configuration.md)")
