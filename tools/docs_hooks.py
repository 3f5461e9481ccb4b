"""mkdocs hooks (``mkdocs.yml``): the configuration reference, written from the typed config tree at every build."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_GENERATOR = Path(__file__).with_name("config_reference.py")


def on_pre_build(config, **kwargs) -> None:
    spec = importlib.util.spec_from_file_location("hybridflow_config_reference", _GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = Path(config["docs_dir"]) / "reference" / "configuration.md"
    text = module.render()
    if not path.is_file() or path.read_text() != text:  # unchanged: no rewrite (mkdocs serve watches the file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
