"""Loaders for each data source, and `build_dataset`, which templates prompts and filters them by length.

Every loader returns a `datasets.Dataset` with a `question` column (the problem text, or a message list) plus the
gold columns its rewards read; `build_dataset` adds `prompt`. Sources are hub ids or local files/folders: a local
folder is read as `<folder>/<split>.jsonl` (kk: `<folder>/<N>ppl_<split>.jsonl`, as in ../shared/data).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .catalog import BUILDERS
from .checks import DataError, DataProblem, check_built_rows, scan_local_file
from .templates import render_prompt

if TYPE_CHECKING:  # pragma: no cover
    from datasets import Dataset

    from .spec import DataSection

logger = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def is_local_source(source: str) -> bool:
    """Whether a `source` names a local file or folder rather than a hub id (checked before loading anything). A hub
    id is `name` or `namespace/name`, so a path with two slashes (`runs/<run>/final`) is local, present or not."""
    return (
        source.startswith(("/", "./", "../", "~"))
        or source.endswith(LOCAL_SUFFIXES)
        or source.count("/") > 1
        or Path(source).exists()
    )


def read_local(path: str | Path) -> Dataset:
    """A local `.jsonl`/`.json`/`.parquet` file as a `Dataset`."""
    from datasets import Dataset

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    if path.suffix == ".parquet":
        return Dataset.from_parquet(str(path))
    return Dataset.from_json(str(path))


def local_file(source: str, stem: str) -> Path:
    """The file a local source names: the file itself, or `<folder>/<stem>.jsonl|.json|.parquet`."""
    path = Path(source).expanduser()
    if path.is_dir():
        found = next((path / f"{stem}{ext}" for ext in LOCAL_SUFFIXES if (path / f"{stem}{ext}").is_file()), None)
        if found is None:
            present = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
            raise FileNotFoundError(f"no {stem}.jsonl/.json/.parquet in {path} (it holds: {present})")
        return found
    return path


def split_source(data: DataSection, which: str) -> tuple[str | None, str | None, int | None]:
    """(source, split, row limit) of the training (`which="train"`) or validation split; split None: no such split."""
    spec = BUILDERS[data.builder]
    if which == "train":
        return data.source or spec.default_source, data.split or spec.default_split, data.max_train_samples
    return data.validation_source or data.source or spec.default_source, data.validation_split, data.validation_size


def local_split_file(data: DataSection, which: str) -> Path | None:
    """The local file a split will be read from, or None (hub data, generated data, or no such split).
    Raises FileNotFoundError for a local folder without the split's file."""
    spec = BUILDERS[data.builder]
    source, split, _ = split_source(data, which)
    if source is None or split is None or not is_local_source(source):
        return None
    options = {name: default for name, (_, default) in spec.options.items()} | dict(data.options)
    return local_file(source, spec.local_stem.format(split=split, **options))


def split_identity(data: DataSection, which: str) -> tuple[Any, ...]:
    """What a split reads, so training and validation can be compared: its local file, its generated side, or its
    hub (source, config, split, files). Raises FileNotFoundError for a local folder without the split's file."""
    spec = BUILDERS[data.builder]
    source, split, _ = split_source(data, which)
    local = local_split_file(data, which)
    if local is not None:
        return ("file", local.resolve())
    if source is None:  # generated: "train" is the training side, any other split the validation side
        return ("generated", split == "train")
    config = data.config if data.config is not None else spec.default_config
    files = tuple(data.data_files) if isinstance(data.data_files, list) else data.data_files
    return ("hub", source, config, split, files)


def same_split_problem(data: DataSection) -> DataProblem | None:
    """A problem when validation would read exactly the rows training reads (validation would then measure
    memorisation, not learning): one local file named for both, or the same hub/generated split."""
    source, split, _ = split_source(data, "validation")
    if split is None:
        return None
    try:
        if split_identity(data, "train") != split_identity(data, "validation"):
            return None
    except FileNotFoundError:  # reported by the split's own scan
        return None
    local = local_split_file(data, "validation")
    fix = "set `data.validation_source` to held-out data (a file, folder or hub id), or drop `data.validation_split`"
    if local is not None and Path(source or "").expanduser().is_file():
        return DataProblem(str(local), f"validation reads the training file: a file source holds one split, so "
                                       f"`data.validation_split: {split}` cannot pick another part of it; {fix} "
                                       "(or make `data.source` a folder of <split>.jsonl files)")  # fmt: skip
    only = " (MATH-500 has one split, test)" if data.builder == "math500" else ""
    where = str(local) if local is not None else f"{source or data.builder} [{split}]"
    return DataProblem(where, f"`data.validation_split: {split}` is the training split{only}: validation would "
                              f"score problems the model trains on; {fix}, or name another split")  # fmt: skip


def ignored_setting_problems(data: DataSection, which: str) -> list[DataProblem]:
    """A problem per `data` key the split's loader would silently ignore: `config` and `data_files` pick among hub
    configs and files, so they mean nothing for a local file or generated data, and `kk` takes its hub config from
    the split (`train`/`test`). The builder's own default config is no choice (a recipe written for the hub names
    it, e.g. GSM8K's `main`, and `--data.source` then points at a local copy of that data), so it passes."""
    source, split, _ = split_source(data, which)
    kind = "generated data" if source is None else "a local source" if is_local_source(source) else None
    where = source or f"{data.builder} [{split}]"
    spec = BUILDERS.get(data.builder)
    default_config = spec.default_config if spec is not None else None
    set_keys = [key for key in ("config", "data_files") if getattr(data, key) is not None]
    if data.config is not None and data.config == default_config:
        set_keys.remove("config")
    named = [data.data_files] if isinstance(data.data_files, str) else list(data.data_files or [])
    if source and named and all(Path(name).name == Path(source).name for name in named):
        set_keys.remove("data_files")  # the hub file a recipe names, and `--data.source` the local copy of it
    problems = []
    if kind is not None:
        problems += [DataProblem(where, f"`data.{key}` is ignored for {kind} (it picks a hub config or files inside "
                                        f"a hub repo): remove it, or name the file to read in `data.source`")
                     for key in set_keys]  # fmt: skip
    elif data.builder == "kk" and data.config is not None:
        problems.append(DataProblem(where, "`data.config` is ignored by the `kk` builder (its hub config is the split, "
                                           "train or test; `data.options.num_people` picks the puzzle size): remove "
                                           "it and set `data.split` / `data.validation_split`"))  # fmt: skip
    return problems


def scan_split_file(data: DataSection, which: str) -> list[DataProblem]:
    """Problems found before anything is loaded: validation reading the training split (`same_split_problem`), then
    the rows of a split's local file (nothing more for hub or generated data; see `checks.scan_local_file`)."""
    try:
        path = local_split_file(data, which)
    except FileNotFoundError as error:
        return [DataProblem(split_source(data, which)[0] or "", str(error))]
    same = same_split_problem(data) if which == "validation" else None
    if same is not None:
        return [same]
    own_source = which == "train" or split_source(data, which)[0] != split_source(data, "train")[0]
    ignored = ignored_setting_problems(data, which) if own_source else []  # said once per source
    if ignored or path is None:
        return ignored
    if not path.is_file():
        return [DataProblem(str(path), "local data file not found")]
    spec = BUILDERS[data.builder]
    hint = "; map your columns with data.columns {prompt: <column>, answer: <column>}" if spec.needs_columns else ""
    return scan_local_file(path, *spec.source_columns(data.columns), hint=hint)


def load_source(
    source: str,
    config: str | None,
    split: str,
    local_name: str | None = None,
    hub_split: str | None = None,
    data_files: str | list[str] | None = None,
):
    """Load a split from a local file, a local folder (`<folder>/<local_name or split>.jsonl|.parquet`) or the hub
    (`data_files` picks files inside a hub repo that holds several)."""
    if is_local_source(source):
        return read_local(local_file(source, local_name or split))
    from datasets import load_dataset

    return load_dataset(source, config, split=hub_split or split, data_files=data_files)


# ---------------------------------------------------------------------------------------------------------------
# Loaders (one per source format)
# ---------------------------------------------------------------------------------------------------------------

GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9][0-9.,]*)")


def gsm8k_gold(worked_solution: str) -> str:
    """The number after `####` with thousands separators removed (GSM8K's official extraction)."""
    match = GSM8K_ANSWER.search(worked_solution)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {worked_solution[-80:]!r}")
    return match.group(1).replace(",", "").rstrip(".")


def load_gsm8k(source: str, config: str | None, split: str, columns: dict[str, str], data_files=None) -> Dataset:
    data = load_source(source, config, split, data_files=data_files)
    bad = [i + 1 for i, text in enumerate(data["answer"]) if not isinstance(text, str) or not GSM8K_ANSWER.search(text)]
    if bad:
        raise DataError([DataProblem(f"{source} [{split}]", "GSM8K answer has no '#### <number>' line", row=row,
                                     column="answer") for row in bad])  # fmt: skip
    return data.map(
        lambda row: {"question": row["question"], "answer": gsm8k_gold(row["answer"])},
        remove_columns=data.column_names,
    )


def load_math500(source: str, config: str | None, split: str, columns: dict[str, str], data_files=None) -> Dataset:
    data = load_source(source, config, split, data_files=data_files)
    keep = ["answer", "level", "subject", "unique_id"]
    data = data.rename_column("problem", "question")
    return data.remove_columns([c for c in data.column_names if c not in ["question", *keep]])


def load_kk(
    source: str, config: str | None, split: str, columns: dict[str, str], data_files=None, num_people: int = 5
) -> Dataset:
    # Hub layout: config = train/test, split = "<N>ppl"; shared-data layout: "<N>ppl_<split>.jsonl".
    data = load_source(
        source,
        split,
        split,
        local_name=BUILDERS["kk"].local_stem.format(split=split, num_people=num_people),
        hub_split=f"{num_people}ppl",
        data_files=data_files,
    )
    data = data.rename_column("quiz", "question")
    keep = ["question", "names", "solution", "solution_text_format"]
    return data.remove_columns([c for c in data.column_names if c not in keep])


BOXED = "\\boxed{"


def last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (brace-matched), or None."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(BOXED)
    for index in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None


def load_areal(source: str, config: str | None, split: str, columns: dict[str, str], data_files=None) -> Dataset:
    """AReaL-style math rows: `prompt` (already templated text) and `solutions` (list; usually `\\boxed{X}`)."""
    data = load_source(source, config, split, data_files=data_files)
    missing = {"prompt", "solutions"} - set(data.column_names)
    if missing:
        raise ValueError(f"AReaL-style data needs columns prompt and solutions; {source} lacks {sorted(missing)}")

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        solutions = row["solutions"] if isinstance(row["solutions"], list) else [row["solutions"]]
        first = str(solutions[0]) if solutions else ""
        boxed = last_boxed_content(first)
        return {"question": row["prompt"], "solutions": [str(s) for s in solutions], "answer": boxed or first}

    return data.map(convert, remove_columns=data.column_names)


def load_table(
    source: str,
    config: str | None,
    split: str,
    columns: dict[str, str],
    data_files=None,
    keep: Iterable[str] = ("answer",),
) -> Dataset:
    """Any table; `columns` maps our names (`prompt`, `answer`, ...) to source column names. The `keep` columns (the
    golds the rewards read) stay as they are when the table has them and `columns` does not name them, so a file
    with `prompt` and `answer` needs no mapping."""
    data = load_source(source, config, split, data_files=data_files)
    mapping = dict(columns)
    prompt_column = mapping.pop("prompt", "prompt")
    wanted = {prompt_column: "question", **{theirs: ours for ours, theirs in mapping.items()}}
    missing = [c for c in wanted if c not in data.column_names]
    if missing:
        raise ValueError(f"{source} has no column(s) {missing}; it has {data.column_names} (fix data.columns)")
    for column in keep:
        if column in data.column_names and column not in wanted and column not in wanted.values():
            wanted[column] = column
    return data.select_columns(list(wanted)).rename_columns({k: v for k, v in wanted.items() if k != v})


def reward_gold_columns(reward_funcs: Iterable[Any] | None) -> list[str]:
    """The columns the rewards read their golds from (`gold_columns()`, else an `answer_key` attribute or bound
    parameter), always with `answer`, the registry's default."""
    columns = ["answer"]
    for reward in reward_funcs or ():
        read = getattr(reward, "gold_columns", None)
        key = getattr(reward, "answer_key", None) or (getattr(reward, "params", None) or {}).get("answer_key")
        found = list(read()) if callable(read) else [key] if isinstance(key, str) else []
        columns += [column for column in found if column not in columns]
    return columns


def unread_gold_problems(
    columns: list[str], reward_funcs: Iterable[Any], where: str, table: bool, source_columns: Callable[[], list[str]]
) -> list[DataProblem]:
    """One problem per reward that would lack a gold column on a split with `columns` (its `missing_columns`), saying
    how to name the column: a `data.columns` entry for a table (`jsonl`/`parquet`), the reward's key otherwise."""
    problems = []
    for reward in reward_funcs:
        check = getattr(reward, "missing_columns", None)
        error = check(columns) if callable(check) else None
        if error is None:
            continue
        name = getattr(reward, "__name__", type(reward).__name__)
        read = getattr(reward, "gold_columns", None)
        absent = [c for c in (read() if callable(read) else ()) if c not in columns]
        if not absent:  # a reward that does not say which columns it reads: its own message
            problems.append(DataProblem(where, f"reward `{name}`: {error}"))
            continue
        present, first = ", ".join(source_columns()) or "none", absent[0]
        own_key = " (or name it in the reward: `params: {answer_key: <your column>}`)"
        own_key = own_key if first == getattr(reward, "answer_key", None) else ""
        if table:
            fix = (f"name your column in the recipe: `data: {{columns: {{{first}: <your column>}}}}`{own_key}; "
                   f"for `prorl-trl eval`: `--columns {first}=<your column>`")  # fmt: skip
        else:
            fix = "point the reward at one of them with its `*_key` parameters (`params: {answer_key: <column>}`)"
        message = f"reward `{name}` reads the gold from column {' / '.join(map(repr, absent))}, which the data does"
        problems.append(DataProblem(where, f"{message} not have (its columns: {present}); {fix}"))
    return problems


def _synthetic(task: str, split: str, options: dict[str, Any], keep: list[str]) -> Dataset:
    """A generated split: `num_train` or `num_validation` rows (`split` "train": the training side, any other: the
    validation side). The sides never share a problem (`synthetic.held_out`); each has its own seed."""
    from datasets import Dataset

    from . import synthetic  # imports `datasets`; written alongside the offline demo

    validation = split != "train"
    size = options.pop("num_validation") if validation else options.pop("num_train")
    options.pop("num_train" if validation else "num_validation", None)
    seed = options.pop("seed") + (1_000_003 if validation else 0)
    for name in ("num_steps", "num_people"):
        if isinstance(options.get(name), list):
            options[name] = tuple(options[name])
    examples = getattr(synthetic, f"{task}_examples")(seed, **options)
    key = "quiz" if task == "kk" else "question"
    try:
        rows = synthetic.split_rows(examples, size, validation, key)
    except synthetic.ProblemSpaceTooSmall as error:
        raise DataError([DataProblem(f"synthetic_{task} [{split}]", f"data.options: {error}")]) from error
    data = Dataset.from_list(rows)
    data = data.remove_columns([c for c in ("question",) if c in data.column_names]).rename_column(
        "prompt", "question"
    )
    return data.remove_columns([c for c in data.column_names if c not in ["question", *keep]])


def load_synthetic_arithmetic(source, config, split: str, columns: dict[str, str], data_files=None, **options):
    return _synthetic("arithmetic", split, options, ["answer", "num_steps"])


def load_synthetic_kk(source, config, split: str, columns: dict[str, str], data_files=None, **options):
    return _synthetic("kk", split, options, ["names", "solution", "solution_text_format", "num_people"])


# ---------------------------------------------------------------------------------------------------------------
# The recipe's entry point
# ---------------------------------------------------------------------------------------------------------------


def prompt_token_count(prompt: str | list[dict[str, str]], tokenizer: Any) -> int:
    """Tokens the model sees for this prompt, counted as TRL's `GRPOTrainer._tokenize_prompts` (trl 1.16) encodes it:
    a chat prompt with the template and the generation header, a plain one with the tokenizer's special tokens
    (`processing_class(text=prompts)`: a BOS-adding tokenizer puts one more token in front)."""
    if isinstance(prompt, list):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return len(ids)
    return len(tokenizer(text=prompt)["input_ids"])


def text_chars(question: Any) -> int:
    """Characters of a problem text (a chat message list: of its contents)."""
    if isinstance(question, list):
        return sum(len(str(message.get("content") or "")) for message in question if isinstance(message, dict))
    return len(str(question))


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token covers: the longest vocabulary entry (byte-level and
    sentencepiece vocabularies spell a token with at least as many symbols as the text it stands for)."""
    return max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))


def drop_overlong_texts(rows: Dataset, limit: int, tokenizer: Any) -> Dataset:
    """Drop rows whose problem text alone cannot fit in `limit` tokens: more than `limit x longest_token_chars`
    characters. Cheap (no rendering, no tokenising), so a megabyte prompt never reaches the tokenizer, which would
    take gigabytes for it; the rows left are then counted exactly (`prompt_token_count`)."""
    bound = limit * longest_token_chars(tokenizer)
    return rows.filter(lambda question: text_chars(question) <= bound, input_columns="question", batch_size=64)


@contextlib.contextmanager
def quiet_datasets(quiet: bool = True) -> Iterator[None]:
    """No `datasets` progress bars inside (its map/filter bars over a few thousand short rows are noise); restores
    the caller's setting."""
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    if quiet and enabled:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if quiet and enabled:
            datasets.enable_progress_bars()


def build_dataset(
    data: DataSection, which: str = "train", tokenizer: Any = None, reward_funcs: Iterable[Any] | None = None
) -> Dataset | None:
    """The training (`which="train"`) or validation split of a recipe's data, with `prompt` + gold columns.

    Returns None for validation when the recipe names no validation split. Raises `DataError` (file, line or row,
    column) for data a run cannot train on, before anything is tokenised: a local file is scanned row by row first
    (`checks.scan_local_file`), and every built split is checked again (`checks.check_built_rows`). The
    prompt-length filter (`data.max_prompt_tokens`, default 2048) needs `tokenizer`; rows it drops are counted.
    A table (`jsonl`/`parquet`) keeps the gold columns `reward_funcs` read (`answer` without them) besides those
    `data.columns` maps; a reward that would still lack its column is refused here, before any sampling.
    """
    spec = BUILDERS[data.builder]
    source, split, limit = split_source(data, which)
    if split is None:
        return None
    problems = scan_split_file(data, which)
    if problems:
        raise DataError(problems)
    local = local_split_file(data, which)
    where = str(local) if local is not None else f"{source or data.builder} [{split}]"
    options = {name: default for name, (_, default) in spec.options.items()} | dict(data.options)
    config = data.config if data.config is not None else spec.default_config
    if spec.needs_columns:
        options["keep"] = reward_gold_columns(reward_funcs)
    try:
        with quiet_datasets(quiet=local is not None or source is None):  # hub downloads keep their progress bars
            rows = spec.load_function()(source, config, split, dict(data.columns), data.data_files, **options)
    except DataError:
        raise
    except Exception as error:  # a hub error, an unreadable file, a generator refusing its options: one message
        raise DataError([DataProblem(where, f"cannot be loaded: {type(error).__name__}: {error}")]) from error
    if reward_funcs:

        def source_columns() -> list[str]:  # only for the message: the table's own columns, before the mapping
            if not spec.needs_columns:
                return [c for c in rows.column_names if c != "question"]
            with quiet_datasets():
                return load_source(source, config, split, data_files=data.data_files).column_names

        problems = unread_gold_problems(rows.column_names, reward_funcs, where, spec.needs_columns, source_columns)
        if problems:
            raise DataError(problems)
    with quiet_datasets():
        return _shape(rows, data, which, where, limit, tokenizer)


def _shape(rows: Dataset, data: DataSection, which: str, where: str, limit: int | None, tokenizer: Any) -> Dataset:
    """Limit, check, length-filter and template a loaded split (see `build_dataset`)."""
    spec = BUILDERS[data.builder]
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    gold = [c for c in rows.column_names if c != "question"] if spec.needs_columns else list(spec.gold_columns)
    problems = check_built_rows(rows, where, gold)
    if problems:
        raise DataError(problems)
    cap = data.max_prompt_tokens
    before = len(rows)
    if cap is not None and tokenizer is not None:
        rows = drop_overlong_texts(rows, cap, tokenizer)
    set_keys = [key for key in ("template", "system_prompt") if getattr(data, key) not in (None, "raw")]  # raw: as is
    if set_keys and len(rows) and isinstance(rows[0]["question"], list):  # a column holds one type
        keys = " and ".join(f"`data.{key}`" for key in set_keys)
        if keys:
            message = (f"the rows are chat message lists, which are used as they are: {keys} would be ignored; "
                       "remove it, or put the system message into the rows")  # fmt: skip
            raise DataError([DataProblem(where, message, column="question")])
    template = data.template or spec.default_template
    prompt_format = data.prompt_format or spec.default_prompt_format
    try:
        rows = rows.map(
            lambda row: {"prompt": render_prompt(row["question"], template, prompt_format, data.system_prompt)},
            writer_batch_size=64,  # rows can be long: never hold a thousand of them in memory
        )
    except ValueError as error:
        raise DataError([DataProblem(where, str(error), column="question")]) from error
    if cap is not None and tokenizer is not None:
        rows = rows.filter(lambda row: prompt_token_count(row["prompt"], tokenizer) <= cap, batch_size=64)
        if len(rows) < before:
            logger.warning("%s: kept %d of %d prompts of <= %d tokens (data.max_prompt_tokens)",
                           which, len(rows), before, cap)  # fmt: skip
    if len(rows) == 0:
        message = (
            f"no rows left: all {before} prompts are longer than data.max_prompt_tokens = {cap} tokens; raise it"
            if before else "has no rows"
        )
        raise DataError([DataProblem(where, message)])
    return rows
