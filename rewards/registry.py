"""The reward registry: `register` for user rewards, `get_reward` to build one, `available` to list them.

The built-ins are listed in `rewards/builtin.py`, which fills `BUILTIN_REWARDS` on import.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any

# The built-in rewards, name -> factory. The table itself is `rewards/builtin.py` (one screen, every built-in in one
# place); it fills this dict when `rewards` is imported. Kept apart so reward modules can look rewards up by name
# (`cosine_scaled`'s checker) without importing the table that imports them.
BUILTIN_REWARDS: dict[str, Callable[..., Callable]] = {}

_USER_REWARDS: dict[str, Callable[..., Callable]] = {}
_REWARD_ARGUMENTS = {"prompts", "completions", "completion_ids"}


def available() -> list[str]:
    """Names `get_reward` accepts: the built-ins and everything registered with `@register`."""
    return sorted({**BUILTIN_REWARDS, **_USER_REWARDS})


class _ParametrizedFunction:
    """A registered reward function with keyword parameters bound, and a `__name__` that says which ones (a
    `functools.partial` would keep the function's name, so two configurations would share TRL's metric)."""

    def __init__(self, function: Callable, name: str, params: dict[str, Any]) -> None:
        self.function, self.params = function, params
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **{**kwargs, **self.params})

    def __repr__(self) -> str:
        return f"<reward {self.__name__}>"


def _is_reward_function(function: Callable) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return bool(_REWARD_ARGUMENTS & set(parameters))


def register(name: str, *, factory: bool | None = None, overwrite: bool = False) -> Callable:
    """Decorator adding a reward to the registry under `name`.

    Register either a reward function (it takes `completions`/`prompts`/`completion_ids`; `get_reward(name, **p)`
    binds the parameters `p` and names the result `name_<param><value>...`), or a factory: a class or function whose
    call with `**params` returns a reward. `factory=None` tells them apart by the signature. A name already taken
    raises unless `overwrite=True`.

    Example:
    ```python
    >>> import rewards
    >>> @rewards.register("shorter_is_better_demo")
    ... def shorter(completions, completion_ids, scale=1.0, **kwargs):
    ...     return [-scale * len(ids) for ids in completion_ids]
    >>> reward = rewards.get_reward("shorter_is_better_demo", scale=0.5)
    >>> reward.__name__, reward(completions=["a", "bb"], completion_ids=[[1], [1, 2]])
    ('shorter_is_better_demo_scale0.5', [-0.5, -1.0])
    ```
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"reward name must be a Python identifier (it becomes a metric name), got {name!r}")

    def decorator(obj: Callable) -> Callable:
        if not callable(obj):
            raise TypeError(f"@register('{name}') needs a function or a class, got {obj!r}")
        if not overwrite and (name in BUILTIN_REWARDS or name in _USER_REWARDS):
            raise ValueError(
                f"a reward named '{name}' is already registered; pick another name or pass overwrite=True"
            )
        is_factory = factory if factory is not None else (inspect.isclass(obj) or not _is_reward_function(obj))
        _USER_REWARDS[name] = obj if is_factory else functools.partial(_bind_function, obj, name)
        return obj

    return decorator


def _bind_function(function: Callable, registered_name: str, name: str | None = None, **params: Any) -> Callable:
    if name is None:
        name = registered_name + "".join(f"_{key}{value}" for key, value in params.items())
    return _ParametrizedFunction(function, name, params)


def get_reward(name: str, /, **params: Any) -> Callable:
    """A TRL reward callable for the registry entry `name`, configured with `params` (`name=` renames its metric).

    Example:
    ```python
    >>> import rewards
    >>> reward = rewards.get_reward("boxed_answer", correct=5.0, incorrect=-5.0)
    >>> reward.__name__, reward(completions=[r"\\boxed{3}", "3"], answer=["#### 3", "#### 3"])
    ('boxed_answer_correct5_incorrect-5', [5.0, -5.0])
    ```
    """
    builder = _USER_REWARDS.get(name) or BUILTIN_REWARDS.get(name)
    if builder is None:
        close = difflib.get_close_matches(name, available(), n=3)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"unknown reward '{name}'.{hint} Available: {', '.join(available())}.")
    try:
        reward = builder(**params)
    except TypeError as error:
        raise TypeError(f"reward '{name}' does not take these parameters {sorted(params)}: {error}") from error
    if not getattr(reward, "__name__", None) and not isinstance(reward, functools.partial):
        try:
            reward.__name__ = params.get("name", name)
        except (AttributeError, TypeError):
            pass
    return reward
