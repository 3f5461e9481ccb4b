"""The version guard behind the patches of libraries' internals (hybridengine/compat.py), on a made-up library."""

import types
import warnings

import pytest

from hybridengine import compat
from hybridengine.compat import CompatError, CompatWarning, LibraryShim, Patch


def fake_shim() -> LibraryShim:
    return LibraryShim(
        "fakelib",
        distributions=("fakelib-cpu", "fakelib"),
        written_for=("1.4",),
        module="tests.fake_compat",
        patches=[
            Patch("frob", why="fakelib frobs at import.", remove_when="fakelib stops frobbing."),
            Patch("speed_up", why="fakelib is slow.", remove_when="fakelib is fast.", optional=True),
        ],
    )


@pytest.fixture(autouse=True)
def no_earlier_warnings(monkeypatch):
    monkeypatch.setattr(compat, "_warned", set())


def installed(monkeypatch, version):
    monkeypatch.setattr(compat, "distribution_version", lambda names: version)


def compat_warnings(caught):
    return [w for w in caught if issubclass(w.category, CompatWarning)]


def test_an_unknown_version_warns_once_per_process_naming_the_patches_and_both_versions(monkeypatch):
    installed(monkeypatch, "2.0.1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fake_shim().check_version() is False
        assert fake_shim().check_version() is False  # a second load of the library's module: no second warning
    (warning,) = compat_warnings(caught)
    text = str(warning.message)
    assert "fakelib 2.0.1 is installed" in text
    assert "written for fakelib 1.4.x" in text
    assert "frob, speed_up" in text and "tests.fake_compat" in text


@pytest.mark.parametrize("version", ["1.4.0", "1.4.7+cpu", "1.4.2rc1", None])
def test_a_version_of_the_series_or_no_library_at_all_is_silent(monkeypatch, version):
    installed(monkeypatch, version)
    shim = fake_shim()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompatWarning)
        assert shim.check_version() is True
    assert shim.version_checked


@pytest.mark.parametrize("version,known", [("1.4.0", True), ("1.40.0", False), ("1.5.0", False), ("0.1.4", False),
                                           ("14.0", False), ("1", False)])
def test_written_for_is_a_release_series(version, known):
    assert fake_shim().is_written_for(version) is known
    exact = LibraryShim("fakelib", ["fakelib"], ["2.13.0"], [], module="m")
    assert exact.is_written_for("2.13.0+cu128") and not exact.is_written_for("2.13.1")
    assert exact.describe_written_for() == "2.13.0"


def test_the_installed_version_is_the_first_installed_distribution(monkeypatch):
    seen = []

    def version(name):
        seen.append(name)
        if name == "fakelib":
            return "1.4.3"
        raise compat.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(compat.importlib.metadata, "version", version)
    assert fake_shim().installed_version() == "1.4.3" and seen == ["fakelib-cpu", "fakelib"]


def test_a_missing_private_name_is_a_compat_error_naming_the_patch_the_name_and_both_versions(monkeypatch):
    installed(monkeypatch, "1.5.0")
    internals = types.ModuleType("fakelib.internals")
    internals._present = 7
    shim = fake_shim()
    assert shim.require(internals, "_present", patch="frob") == 7
    with pytest.raises(CompatError) as error:
        shim.require(internals, "_gone", patch="frob")
    text = str(error.value)
    assert "fakelib patch 'frob' needs fakelib.internals._gone" in text
    assert "fakelib 1.5.0 is installed" in text and "written for fakelib 1.4.x" in text
    assert "fakelib frobs at import." in text
    assert isinstance(error.value, RuntimeError)

    class Engine:
        pass

    with pytest.raises(CompatError, match=r"needs test_compat\..*Engine instance\._seed"):
        shim.require(Engine(), "_seed", patch="frob")
    with pytest.raises(CompatError, match=r"needs the module fakelib\._nowhere, which cannot be imported"):
        shim.import_module("fakelib._nowhere", patch="frob")


def test_a_missing_parameter_is_a_compat_error_naming_it():
    shim = fake_shim()

    def step(tokens, generation_started=None):
        pass

    shim.require_parameters(step, ["tokens", "generation_started"], patch="frob")
    with pytest.raises(CompatError, match=r"test_a_missing.*step to take parameters \['termination_id'\]; it takes "
                                          r"\['tokens', 'generation_started'\]"):
        shim.require_parameters(step, ["tokens", "termination_id"], patch="frob")


def test_an_unregistered_patch_name_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match=r"fakelib has no registered patch 'frobb'; registered: \['frob', 'speed_up'\]"):
        fake_shim().require(object(), "__class__", patch="frobb")


def test_an_optional_patch_is_skipped_with_one_warning_when_its_name_is_missing(monkeypatch):
    installed(monkeypatch, "1.6.0")
    shim = fake_shim()
    internals = types.ModuleType("fakelib.internals")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert shim.optional(internals, "_queue", patch="speed_up", default=False) is False
        assert shim.optional(internals, "_queue", patch="speed_up") is None
    (warning,) = compat_warnings(caught)
    assert "fakelib patch 'speed_up' skipped: fakelib.internals._queue is missing" in str(warning.message)
    assert "fakelib 1.6.0 is installed" in str(warning.message)
    internals._queue = "q"
    assert shim.optional(internals, "_queue", patch="speed_up") == "q"
    with pytest.raises(ValueError, match="'frob' is not optional"):
        shim.optional(internals, "_queue", patch="frob")


def test_applies_puts_the_patch_line_in_the_docstring_and_records_the_function():
    shim = fake_shim()

    @shim.applies("frob")
    def frob():
        """Frob fakelib.

        Twice.
        """

    assert frob.__doc__ == ("Frob fakelib.\n\nTwice.\n\nPatch ``frob``: fakelib frobs at import. "
                            "Remove when: fakelib stops frobbing.")
    assert shim.applied_by == {"frob": f"{__name__}.{frob.__qualname__}"}
    with pytest.raises(ValueError, match="no registered patch 'nope'"):
        shim.applies("nope")


def test_every_patch_needs_a_why_and_a_remove_when_line_and_a_name_of_its_own():
    with pytest.raises(ValueError, match="patch 'frob' needs a why and a remove_when line"):
        LibraryShim("fakelib", ["fakelib"], ["1.4"], [Patch("frob", why="x", remove_when=" ")], module="m")
    with pytest.raises(ValueError, match="patch 'frob' is registered twice"):
        LibraryShim("fakelib", ["fakelib"], ["1.4"], [Patch("frob", "x", "y"), Patch("frob", "x", "y")], module="m")
