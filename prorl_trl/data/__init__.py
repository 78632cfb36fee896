"""Dataset builders: a recipe's `data:` section (`spec.DataSection`) -> a `datasets.Dataset` with `prompt` + gold columns.

`catalog` is the one place that says which builders exist (no heavy imports); `builders` loads and shapes the data
(`datasets` is imported only then); `templates` renders prompts; `synthetic` generates the demo's tasks.
"""

from __future__ import annotations

from typing import Any

from .catalog import BUILDERS, BuilderSpec, available_builders
from .spec import DataSection


def build_dataset(*args: Any, **kwargs: Any) -> Any:
    """See `prorl_trl.data.builders.build_dataset` (imported lazily: it needs `datasets`)."""
    from .builders import build_dataset as _build

    return _build(*args, **kwargs)


__all__ = ["BUILDERS", "BuilderSpec", "DataSection", "available_builders", "build_dataset"]
