"""The configuration tree: defaults, YAML + dotted overrides, typed parsing, descriptions, presets."""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from meshtrain.config import (
    ConfigError,
    DataConfig,
    ModelArgs,
    ModelConfig,
    SHARED_FOLDERS,
    ParallelConfig,
    ScalingConfig,
    TrainConfig,
)
from meshtrain.config.loading import describe_fields, load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.cluster.preflight import preflight
from meshtrain.config.presets import MODEL_PRESETS
from meshtrain.model.args import model_args
from meshtrain.model.llama import build_model, count_parameters


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- defaults -------------------------------------------------------------------------------------


def test_defaults_validate() -> None:
    cfg = MeshtrainConfig()
    assert load_config() == cfg
    assert load_config(None, []) == cfg
    assert cfg.model.preset == "debug"
    assert cfg.data.source == "stdlib" and cfg.data.tokenizer == "train"
    assert cfg.parallel.strategy == "hybrid_shard" and cfg.parallel.shard == "auto"
    assert cfg.scaling.num_workers == 2 and cfg.scaling.use_gpu is False
    # The defaults must also describe a runnable batch layout and model.
    micro, accumulation = cfg.train.batch_layout(cfg.scaling.num_workers)
    assert micro * cfg.scaling.num_workers * accumulation == cfg.train.global_batch_size
    args = model_args(cfg.model, cfg.data.vocab_size)
    assert isinstance(args, ModelArgs)
    assert cfg.data.seq_len <= args.max_seq_len


def test_default_instances_are_independent() -> None:
    first, second = MeshtrainConfig(), MeshtrainConfig()
    first.train.steps = 7
    assert second.train.steps == 200


def test_assignment_is_validated() -> None:
    cfg = MeshtrainConfig()
    with pytest.raises(ValueError):
        cfg.train.steps = 0


# --- precedence: defaults < YAML file < overrides --------------------------------------------------


def test_yaml_then_overrides_precedence(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "run.yaml",
        "train:\n  steps: 50\n  seed: 3\noptim:\n  lr: 1.0e-3\nparallel:\n  strategy: full_shard\n",
    )
    cfg = load_config(path, ["train.steps=7", "optim.warmup_steps=2"])
    assert cfg.train.steps == 7  # override beats the file
    assert cfg.train.seed == 3  # file beats the default
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.optim.warmup_steps == 2  # override of a key the file does not set
    assert cfg.parallel.strategy == "full_shard"
    assert cfg.train.log_every == TrainConfig().log_every  # untouched default
    assert load_config(path).train.steps == 50


def test_later_override_wins() -> None:
    assert load_config(None, ["train.steps=70", "train.steps=90"]).train.steps == 90


def test_override_may_replace_yaml_scalar_with_auto(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "run.yaml",
        "scaling:\n  num_workers: 4\ntrain:\n  global_batch_size: 32\nparallel:\n  shard: 2\n",
    )
    assert load_config(path).parallel.shard == 2
    assert load_config(path, ["parallel.shard=auto"]).parallel.shard == "auto"


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path / "empty.yaml", "")) == MeshtrainConfig()
    assert load_config(_write(tmp_path / "comment.yaml", "# nothing\n")) == MeshtrainConfig()


def test_config_path_accepts_str_and_path(tmp_path: Path) -> None:
    path = _write(tmp_path / "run.yaml", "train:\n  steps: 110\n")
    assert load_config(str(path)).train.steps == 110
    assert load_config(path).train.steps == 110


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(info.value) == f"--config: {str(missing)!r} is not a file; give a YAML config path"


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.yaml", "train:\n  steps: 5\n  seed: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"--config: {path} is not valid YAML at line ")
    assert message.endswith("; fix the syntax")
    assert "\n" not in message


def test_yaml_list_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path / "list.yaml", "- train\n- model\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"--config: {path} must hold a mapping of sections (model:, train:, ...)"


def test_yaml_unknown_key_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path / "typo.yaml", "optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"^optim\.learning_rate: unknown setting; optim accepts lr, "):
        load_config(path)


# --- typed parsing of overrides ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "section", "field", "expected", "kind"),
    [
        ("train.steps=100", "train", "steps", 100, int),
        ("train.seed=-1", "train", "seed", -1, int),
        ("optim.lr=0.25", "optim", "lr", 0.25, float),
        ("optim.lr=1e-4", "optim", "lr", 1e-4, float),  # YAML 1.1 reads this as text; pydantic as float
        ("optim.lr=2", "optim", "lr", 2.0, float),
        ("optim.min_lr_ratio=0", "optim", "min_lr_ratio", 0.0, float),
        ("scaling.cpus_per_worker=0.5", "scaling", "cpus_per_worker", 0.5, float),
        ("scaling.use_gpu=true", "scaling", "use_gpu", True, bool),
        ("parallel.cpu_offload=false", "parallel", "cpu_offload", False, bool),
        ("parallel.shard=auto", "parallel", "shard", "auto", str),
        ("parallel.shard=2", "parallel", "shard", 2, int),
        ("parallel.shard='2'", "parallel", "shard", 2, int),
        ("parallel.shard=1", "parallel", "shard", 1, int),
        ("parallel.strategy=no_shard", "parallel", "strategy", "no_shard", str),
        ("model.preset=125m", "model", "preset", "125m", str),
        ("model.tie_embeddings=true", "model", "tie_embeddings", True, bool),
        ("model.rope_theta=500000", "model", "rope_theta", 500000.0, float),
        ("data.seq_len=64", "data", "seq_len", 64, int),
        ("data.source=stdlib", "data", "source", "stdlib", str),
        ("data.max_documents=10", "data", "max_documents", 10, int),
        ("run.name=my-run", "run", "name", "my-run", str),
        # Free-text settings keep what was typed even when it looks like a number or a boolean.
        ("run.name=2024", "run", "name", "2024", str),
        ("run.name=1.10", "run", "name", "1.10", str),
        ("data.hf_config=20220301", "data", "hf_config", "20220301", str),
        ("data.split=7", "data", "split", "7", str),
        ("run.name=", "run", "name", None, type(None)),  # empty = unset
        ("run.max_failures=-1", "run", "max_failures", -1, int),
        ("train.steps= 120 ", "train", "steps", 120, int),
    ],
)
def test_override_types(override: str, section: str, field: str, expected: object, kind: type) -> None:
    cfg = load_config(None, [override])
    value = getattr(getattr(cfg, section), field)
    assert type(value) is kind, (override, value)
    assert value == expected


def test_value_may_contain_equals_sign() -> None:
    assert load_config(None, ["run.name=a=b"]).run.name == "a=b"


def test_shard_with_more_workers() -> None:
    cfg = load_config(None, ["scaling.num_workers=4", "parallel.shard=2", "train.global_batch_size=32"])
    assert (cfg.scaling.num_workers, cfg.parallel.shard) == (4, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train"], "override 'train': expected dotted.key=value, e.g. train.steps=100"),
        (["train.steps"], "override 'train.steps': expected dotted.key=value, e.g. train.steps=100"),
        (["train..steps=1"], "override 'train..steps=1': empty key segment; expected dotted.key=value"),
        (["train.steps=5", "train.steps.x=1"], "train.steps.x: 'steps' is a value, not a section"),
        (
            ["train.stepz=5"],
            "train.stepz: unknown setting; train accepts " + ", ".join(TrainConfig.model_fields),
        ),
        (
            ["foo.bar=1"],
            "foo: unknown setting; top level accepts " + ", ".join(MeshtrainConfig.model_fields),
        ),
        (
            ["train.steps=abc"],
            "train.steps: Input should be a valid integer, unable to parse string as an integer (got 'abc')",
        ),
        (["train.steps=0"], "train.steps: Input should be greater than 0 (got 0)"),
        (["train.steps=-3"], "train.steps: Input should be greater than 0 (got -3)"),
        (["train.steps="], "train.steps: Input should be a valid integer (got an empty value)"),
        (
            ["train.steps.x=1"],
            "train.steps: Input should be a valid integer (got a mapping of sub-keys, not a single value)",
        ),
        (["optim.lr=-1"], "optim.lr: Input should be greater than 0 (got -1)"),
        (["metrics.port=70000"], "metrics.port: Input should be less than or equal to 65535 (got 70000)"),
        (
            ["metrics.bind_address=localhost"],
            "metrics.bind_address: must be an IP address such as 0.0.0.0 or 127.0.0.1, got 'localhost'",
        ),
        (["metrics.peak_flops_per_s=0"], "metrics.peak_flops_per_s: Input should be greater than 0 (got 0)"),
        (["optim.beta2=1"], "optim.beta2: Input should be less than 1 (got 1)"),
        (
            ["scaling.use_gpu=maybe"],
            "scaling.use_gpu: Input should be a valid boolean, unable to interpret input (got 'maybe')",
        ),
        (["parallel.shard=0"], "parallel.shard: expected a positive integer or 'auto', got 0"),
        (["parallel.shard=-2"], "parallel.shard: expected a positive integer or 'auto', got -2"),
        (["parallel.shard=abc"], "parallel.shard: expected a positive integer or 'auto', got 'abc'"),
        (["parallel.shard=2.5"], "parallel.shard: expected a positive integer or 'auto', got 2.5"),
        (["parallel.shard=true"], "parallel.shard: expected a positive integer or 'auto', got True"),
        (["parallel.shard=3"], "parallel.shard=3 does not divide scaling.num_workers=2; choose one of 1, 2"),
        (
            # The batch divides 4 workers, so the mesh (checked by preflight, after the schema) is the error.
            ["scaling.num_workers=4", "parallel.shard=3", "train.global_batch_size=32"],
            "parallel.shard=3 does not divide scaling.num_workers=4; choose one of 1, 2, 4",
        ),
        (
            ["scaling.num_workers=6", "scaling.workers_per_node=4", "train.global_batch_size=48"],
            "parallel.shard=auto: 4 workers per node do not divide scaling.num_workers=6; "
            "set parallel.shard to one of 1, 2, 3, 6",
        ),
        (
            ["parallel.strategy=no_shard", "parallel.shard=2"],
            "parallel.shard=2 conflicts with parallel.strategy=no_shard, which replicates parameters on "
            "every worker; use strategy hybrid_shard or drop parallel.shard",
        ),
        (
            ["parallel.strategy=bogus"],
            "parallel.strategy: Input should be 'full_shard', 'shard_grad_op', 'no_shard', 'hybrid_shard' "
            "or 'hybrid_shard_zero2' (got 'bogus')",
        ),
        (
            ["model.preset=llama9"],
            "model.preset: unknown preset 'llama9'; choose one of " + ", ".join(MODEL_PRESETS),
        ),
        (
            ["data.seq_len=2048"],
            "data.seq_len=2048 exceeds model.max_seq_len=1024; lower data.seq_len or raise model.max_seq_len",
        ),
        (
            ["train.global_batch_size=12"],
            "train.global_batch_size=12 is not a multiple of train.micro_batch_size (8) x data-parallel "
            "workers (2); make it a multiple of 16",
        ),
        (
            ["scaling.num_workers=3"],
            "train.global_batch_size=16 is not a multiple of train.micro_batch_size (8) x data-parallel "
            "workers (3); make it a multiple of 24",
        ),
        (
            ["model.vocab_size=100"],
            "model.vocab_size: 100 is smaller than the tokenizer's 2048 tokens; raise it or leave it unset",
        ),
        (
            ["model.dim=100"],
            "model.dim=100: the head size model.dim / model.n_heads=4 is 25, which must be even for rotary "
            "embeddings; change model.dim or model.n_heads",
        ),
        (["model.n_kv_heads=3"], "model.n_kv_heads=3 must divide model.n_heads=4"),
        (["model.dim=130"], "model.dim=130 must be divisible by model.n_heads=4"),
        (
            ["run.name=a/b"],
            "run.name: must be a plain folder name (no '/', not '.' or '..'), got 'a/b'",
        ),
        (["run.name=.."], "run.name: must be a plain folder name (no '/', not '.' or '..'), got '..'"),
        (
            ["run.name=token_stores"],
            "run.name: 'token_stores' is a folder every run under run.storage_path shares (token_stores, "
            "prometheus); choose another run.name",
        ),
        (
            ["run.storage_path=s3://alice:pw@bucket/runs"],
            "run.storage_path: must be a directory (on a cluster, one every node mounts), not a URL, got "
            "'s3://alice:<redacted>@bucket/runs'; put s3:// storage in checkpoint.path and data.cache_dir",
        ),
        (
            ["data.source=/nonexistent/x.jsonl"],
            "data.source: no files at '/nonexistent/x.jsonl'; give an existing file, directory or glob, "
            "a token store, 'stdlib', or 'hf:<dataset>'",
        ),
        (
            ["data.tokenizer=/nonexistent/tokenizer.json"],
            "data.tokenizer: '/nonexistent/tokenizer.json' is not a file; "
            "give a tokenizer.json path or 'train'",
        ),
        (["data.vocab_size=10"], "data.vocab_size: Input should be greater than or equal to 260 (got 10)"),
        (
            ["data.seq_len=524288", "data.cache_max_bytes=2097152"],
            "data.cache_max_bytes=2097152 cannot hold one read of data.seq_len=524288 (2099204 bytes); raise "
            "data.cache_max_bytes (a few GiB is typical)",
        ),
    ],
)
def test_bad_overrides(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        preflight(load_config(None, overrides))  # the schema's errors, then those against the world
    assert str(info.value) == message


def test_error_messages_are_single_lines() -> None:
    for overrides in (["train.stepz=5"], ["train.steps=abc"], ["parallel.shard=3"], ["data.seq_len=4096"]):
        with pytest.raises(ConfigError) as info:
            preflight(load_config(None, overrides))
        assert "\n" not in str(info.value)


# --- data paths ----------------------------------------------------------------------------------


def test_local_data_sources(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    _write(corpus / "a.jsonl", '{"text": "hello"}\n')
    _write(corpus / "sub" / "b.jsonl", '{"text": "world"}\n')
    assert load_config(None, [f"data.source={corpus / 'a.jsonl'}"]).data.source.endswith("a.jsonl")
    assert load_config(None, [f"data.source={corpus}"]).data.source == str(corpus)
    assert load_config(None, [f"data.source={corpus}/**/*.jsonl"])
    assert load_config(None, ["data.source=hf:someone/dataset"]).data.source == "hf:someone/dataset"


def test_directory_without_data_files_is_rejected(tmp_path: Path) -> None:
    _write(tmp_path / "notes.md", "not a data file")
    with pytest.raises(ConfigError, match=r"^data\.source: no files at "):
        preflight(load_config(None, [f"data.source={tmp_path}"]))


def test_existing_tokenizer_file_is_accepted(tmp_path: Path) -> None:
    path = _write(tmp_path / "tokenizer.json", "{}")
    assert DataConfig(tokenizer=str(path)).tokenizer == str(path)


# --- no float setting takes inf or nan -----------------------------------------------------------


def _float_fields(model: type[BaseModel], prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Paths of every float (or float | None) setting, through sections and lists of sections (index 0)."""
    paths: list[tuple[str | int, ...]] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
        for member in members:
            if isinstance(member, type) and issubclass(member, BaseModel):
                paths.extend(_float_fields(member, (*prefix, name)))
            elif get_origin(member) is list and issubclass(get_args(member)[0], BaseModel):
                paths.extend(_float_fields(get_args(member)[0], (*prefix, name, 0)))
            elif member is float:
                paths.append((*prefix, name))
    return paths


_PLACEHOLDERS: dict[Any, Any] = {str: "x", dict[str, float]: {"x": 1.0}}


def _override(path: tuple[str | int, ...], value: str) -> str:
    """``dotted.key=value``; a list on the way becomes a one-item YAML list: ``data.sources=[{weight: inf}]``,
    the item's required fields given placeholders (``data.stages=[{name: x, weights: {x: 1.0}, lr_decay_to: inf}]``)."""
    model: Any = MeshtrainConfig
    for index, part in enumerate(path):
        if isinstance(part, int):
            item: Any = value
            for key in reversed(path[index + 1 :]):
                item = {key: item}
            required = {name: _PLACEHOLDERS[field.annotation] for name, field in model.model_fields.items()
                        if field.is_required() and name not in item}
            listed = yaml.safe_dump([{**required, **item}], default_flow_style=True).strip()
            return f"{'.'.join(map(str, path[:index]))}={listed}"
        annotation = model.model_fields[part].annotation
        members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
        model = next((get_args(m)[0] if get_origin(m) is list else m) for m in members
                     if m is not type(None) and (get_origin(m) is list or isinstance(m, type)))
    return f"{'.'.join(map(str, path))}={value}"


FLOAT_PATHS = _float_fields(MeshtrainConfig)
FLOAT_FIELDS = [".".join(map(str, path)) for path in FLOAT_PATHS]


def test_float_fields_are_discovered() -> None:
    expected = {"optim.lr", "model.norm_eps", "metrics.peak_flops_per_s", "data.sources.0.weight"}
    assert expected <= set(FLOAT_FIELDS)
    assert "train.steps" not in FLOAT_FIELDS and "scaling.use_gpu" not in FLOAT_FIELDS


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("path", FLOAT_PATHS, ids=FLOAT_FIELDS)
def test_float_settings_must_be_finite(path: tuple[str | int, ...], value: str) -> None:
    name = ".".join(map(str, path))
    with pytest.raises(ConfigError) as info:
        load_config(None, [_override(path, value)])
    assert str(info.value).startswith(f"{name}: Input should be a finite number (got "), str(info.value)
    assert "\n" not in str(info.value)


def _duration_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of the settings in seconds (``*_s``, not ``*_per_s``), nested sections included."""
    names = []
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            names += _duration_fields(info.annotation, f"{prefix}{name}.")
        elif name.endswith("_s") and not name.endswith("_per_s"):
            names.append(prefix + name)
    return names


DURATION_FIELDS = sorted(_duration_fields(MeshtrainConfig))


@pytest.mark.parametrize("name", DURATION_FIELDS)
def test_every_duration_is_bounded_by_what_its_consumers_convert(name: str) -> None:
    """A year at most: 1e300 seconds passed every "> 0" check and then overflowed a conversion to
    milliseconds in a worker."""
    assert len(DURATION_FIELDS) >= 14
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{name}=31536001"])
    assert str(info.value) == f"{name}: Input should be less than or equal to 31536000 (got 31536001)"


def test_non_finite_message() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["optim.lr=inf"])
    assert str(info.value) == "optim.lr: Input should be a finite number (got 'inf')"


def test_non_finite_yaml_float(tmp_path: Path) -> None:
    path = _write(tmp_path / "run.yaml", "model:\n  norm_eps: .inf\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == "model.norm_eps: Input should be a finite number (got inf)"


# --- storage schemes -----------------------------------------------------------------------------

TESTED_LOCATIONS = ["/mnt/ckpt", "relative/ckpt", "~/ckpt", "file:///mnt/ckpt", "s3://bucket/prefix"]
UNTESTED_LOCATIONS = [
    ("gs://bucket/prefix", "gs"),
    ("gcs://bucket/prefix", "gcs"),
    ("az://container/prefix", "az"),
    ("hdfs://namenode/prefix", "hdfs"),
    ("memory://prefix", "memory"),
    ("simplecache::s3://bucket/prefix", "simplecache::s3"),
]


@pytest.mark.parametrize("location", TESTED_LOCATIONS)
def test_tested_storage_schemes_are_accepted(location: str) -> None:
    cfg = load_config(None, [f"checkpoint.path={location}", f"data.cache_dir={location}"])
    assert (cfg.checkpoint.path, cfg.data.cache_dir) == (location, location)


@pytest.mark.parametrize(("location", "scheme"), UNTESTED_LOCATIONS)
def test_untested_checkpoint_scheme_is_refused_unless_allowed(location: str, scheme: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"checkpoint.path={location}"])
    assert str(info.value) == (
        f"checkpoint.path: scheme {scheme!r} is not tested with meshtrain (local paths and s3:// are); "
        "use one of those or set checkpoint.allow_untested_scheme=true"
    )
    cfg = load_config(None, [f"checkpoint.path={location}", "checkpoint.allow_untested_scheme=true"])
    assert cfg.checkpoint.path == location


@pytest.mark.parametrize(("location", "scheme"), UNTESTED_LOCATIONS)
def test_untested_cache_scheme_is_refused(location: str, scheme: str) -> None:
    message = (
        f"data.cache_dir: scheme {scheme!r} is not tested with meshtrain (local paths and s3:// are); "
        "use one of those"
    )
    for overrides in ([], ["checkpoint.allow_untested_scheme=true"]):  # that opt-in is for checkpoints only
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"data.cache_dir={location}", *overrides])
        assert str(info.value) == message


# --- every setting is documented -----------------------------------------------------------------


def _walk(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str | None, bool]]:
    """(dotted name, description, is a section) for every field, sections included."""
    rows: list[tuple[str, str | None, bool]] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        rows.append((f"{prefix}{name}", field.description, is_section))
        if is_section:
            rows.extend(_walk(annotation, f"{prefix}{name}."))
    return rows


def test_every_field_has_a_description() -> None:
    rows = _walk(MeshtrainConfig)
    assert {name for name, _, is_section in rows if is_section} == {
        "model", "data", "optim", "train", "parallel", "scaling", "run", "checkpoint", "metrics", "fault", "fault_tolerance", "eval",
        "data.validation", "eval.downstream", "eval.samples", "profile", "memory",
    }
    assert len(rows) > 50
    missing = [name for name, description, _ in rows if not (description and description.strip())]
    assert missing == []


def test_describe_fields_lists_every_leaf_setting() -> None:
    leaves = [name for name, _, is_section in _walk(MeshtrainConfig) if not is_section]
    rows = describe_fields()
    assert [name for name, _, _ in rows] == leaves
    assert all(description.strip() for _, _, description in rows)
    assert ("train.steps", "200", TrainConfig.model_fields["steps"].description) in rows
    assert ("parallel.shard", "'auto'", ParallelConfig.model_fields["shard"].description) in rows


def test_preset_description_lists_every_preset() -> None:
    description = ModelConfig.model_fields["preset"].description or ""
    for preset in MODEL_PRESETS:
        assert preset in description


# --- model presets -------------------------------------------------------------------------------

# preset -> (parameter range, tied embeddings, vocab used when the preset has none)
PRESETS = {
    "debug": ((1_000_000, 2_000_000), False),
    "125m": ((100_000_000, 150_000_000), False),
    "llama3_1b": ((1_200_000_000, 1_300_000_000), True),
    "llama3_8b": ((7_900_000_000, 8_100_000_000), False),
    "llama3_70b": ((69_500_000_000, 71_000_000_000), False),
    "llama3_405b": ((405_000_000_000, 406_500_000_000), False),
    "llama3.2_1b": ((1_200_000_000, 1_300_000_000), True),
    "llama3.2_3b": ((3_150_000_000, 3_300_000_000), True),
    "llama3.1_8b": ((7_900_000_000, 8_100_000_000), False),
}


def test_preset_table_covers_every_preset() -> None:
    assert set(PRESETS) == set(MODEL_PRESETS)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_builds_on_meta_with_expected_size(preset: str) -> None:
    (low, high), tied = PRESETS[preset]
    cfg = load_config(None, [f"model.preset={preset}"])
    args = model_args(cfg.model, 2048)
    assert args == ModelConfig(preset=preset).resolved(2048)
    model = build_model(args, "meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    total = count_parameters(model)
    assert low <= total <= high, f"{preset}: {total:,} parameters"
    assert args.tie_embeddings is tied
    assert (model.output.weight is model.tok_embeddings.weight) is tied
    if MODEL_PRESETS[preset]["vocab_size"] is not None:
        assert args.vocab_size == MODEL_PRESETS[preset]["vocab_size"]
    if tied:
        # Counted once: the untied model would be larger by one vocab x dim matrix.
        assert total == sum(p.numel() for p in model.parameters())
        assert total + args.vocab_size * args.dim > high


def test_llama3_shapes() -> None:
    args = ModelConfig(preset="llama3_8b").resolved(128000)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim) == (4096, 32, 32, 8, 14336)
    assert args.vocab_size == 128256 and args.rope_theta == 500000.0 and args.head_dim == 128
    args = ModelConfig(preset="llama3_70b").resolved(None)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (8192, 80, 64, 8)
    args = ModelConfig(preset="llama3_405b").resolved(None)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim) == (16384, 126, 128, 8, 53248)
    assert args.vocab_size == 128256 and args.rope_theta == 500000.0 and args.head_dim == 128


def test_tokenizer_vocab_is_rounded_up_when_the_preset_has_none() -> None:
    assert ModelConfig().resolved(2048).vocab_size == 2048
    assert ModelConfig().resolved(2000).vocab_size == 2048
    assert ModelConfig().resolved(2049).vocab_size == 2112
    # A preset's own vocabulary wins when the tokenizer fits in it.
    assert ModelConfig(preset="125m").resolved(2000).vocab_size == 32000


def test_explicit_fields_override_the_preset() -> None:
    cfg = load_config(None, ["model.preset=125m", "model.n_layers=2", "model.vocab_size=50304"])
    args = model_args(cfg.model, 50257)
    assert (args.dim, args.n_layers, args.vocab_size) == (768, 2, 50304)
    assert count_parameters(build_model(args, "meta")) < 100_000_000


def test_vocab_must_be_known() -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig().resolved(None)
    assert str(info.value) == "model.vocab_size: unknown; set it or let the tokenizer define it"


def test_tokenizer_larger_than_the_preset_vocab() -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig(preset="125m").resolved(50257)
    assert str(info.value) == (
        "model.vocab_size: 32000 is smaller than the tokenizer's 50257 tokens; raise it or leave it unset"
    )


def test_longer_sequences_need_a_longer_rope_table() -> None:
    cfg = load_config(None, ["data.seq_len=2048", "model.max_seq_len=2048"])
    assert model_args(cfg.model, 2048).max_seq_len == 2048
    assert load_config(None, ["model.preset=llama3_8b", "data.seq_len=8192"]).data.seq_len == 8192


# --- batch layout --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("global_batch", "micro", "dp", "expected"),
    [(16, 8, 2, (8, 1)), (64, 1, 16, (1, 4)), (32, 4, 2, (4, 4)), (8, 8, 1, (8, 1))],
)
def test_batch_layout(global_batch: int, micro: int, dp: int, expected: tuple[int, int]) -> None:
    cfg = MeshtrainConfig(
        train=TrainConfig(global_batch_size=global_batch, micro_batch_size=micro),
        scaling=ScalingConfig(num_workers=dp),
    )
    assert cfg.train.batch_layout(dp) == expected


def test_batch_layout_error() -> None:
    with pytest.raises(ConfigError) as info:
        MeshtrainConfig().train.batch_layout(3)
    assert str(info.value) == (
        "train.global_batch_size=16 is not a multiple of train.micro_batch_size (8) x "
        "data-parallel workers (3); make it a multiple of 24"
    )


# --- the shipped job configs ---------------------------------------------------------------------

JOB_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "jobs" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=[path.name for path in JOB_CONFIGS])
def test_shipped_job_config_validates(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.model.preset in MODEL_PRESETS
    assert cfg.train.batch_layout(cfg.scaling.num_workers // cfg.parallel.group_size)[1] >= 1
    # Written back whole (config.yaml, a checkpoint's manifest, --dry-run), it reads back the same.
    assert MeshtrainConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_debug_job_config_is_the_default() -> None:
    path = Path(__file__).resolve().parents[1] / "jobs" / "configs" / "debug.yaml"
    if not path.is_file():
        pytest.skip("jobs/configs/debug.yaml is not there")
    assert load_config(path) == MeshtrainConfig()


def test_the_config_knows_the_remote_check_block() -> None:
    from meshtrain.config.data import CHECK_BLOCK_BYTES
    from meshtrain.data.remote import CHECK_BYTES

    assert CHECK_BLOCK_BYTES == CHECK_BYTES


def test_every_shared_folder_is_a_reserved_run_name(tmp_path: Path) -> None:
    """The folders the launcher and the metrics put beside the runs are the ones no run may be named."""
    from meshtrain.observe.metrics import targets_path

    cfg = load_config(None, [f"run.storage_path={tmp_path}"])
    assert {Path(cfg.data_cache_url()).name, targets_path(None, str(tmp_path), "run").parent.name} == set(SHARED_FOLDERS)
    for name in SHARED_FOLDERS:
        with pytest.raises(ConfigError, match=rf"^run.name: '{name}' is a folder every run .* choose another run.name$"):
            load_config(None, [f"run.name={name}"])


def test_a_replica_groups_name_is_a_reserved_run_name(tmp_path: Path) -> None:
    """Ray Train keeps a replica group's records in a folder beside the run's, and the metrics write its
    Prometheus targets file, under one name: no run may take it."""
    from meshtrain.config import replica_group_name
    from meshtrain.observe.metrics import targets_name

    taken = replica_group_name("a20", 0)
    assert targets_name("a20", 0) == taken
    with pytest.raises(ConfigError, match=r"^run.name: 'a20.replica0' is how replica group 0 of a run 'a20' names its "
                                          r"Ray records and Prometheus targets; choose a run.name that does not end in "
                                          r"\.replica<N>$"):
        load_config(None, [f"run.name={taken}"])
    for name in ("a20.replica", "replica0", "a20.replica0.b"):
        assert load_config(None, [f"run.name={name}"]).run.name == name


# --- hostile YAML and names ---------------------------------------------------------------------


def _billion_laughs(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\ntrain:\n  steps: *a{levels - 1}\n"


@pytest.mark.parametrize("levels", [5, 9])  # 10^5 and 10^9 leaves
def test_a_yaml_alias_bomb_is_one_short_line_at_once(levels: int, tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_billion_laughs(levels))
    with pytest.raises(ConfigError) as info:  # 10^9 leaves: it returns only because they are counted to the bound
        load_config(path)
    assert str(info.value) == (f"--config: {path} expands to more than 100,000 values (YAML aliases repeating one "
                               "another); write the settings out")


def test_an_override_alias_bomb_and_a_long_value_stay_short() -> None:
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    with pytest.raises(ConfigError, match="^override train.steps expands to more than 100,000 values"):
        load_config(None, ["train.steps={" + ", ".join(levels) + "}"])
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.steps=[" + ", ".join(["1"] * 5000) + "]"])
    assert len(str(info.value)) < 300 and str(info.value).endswith("...)")


def test_a_key_set_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  steps: 5\n  log_every: 1\n  steps: 6\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"--config: {path} sets 'steps' twice in one mapping (lines 2 and 4); keep one"


def test_yaml_merge_keys_may_override_what_they_merge(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("base: &base {steps: 5, log_every: 1}\ntrain:\n  <<: *base\n  steps: 7\n")
    with pytest.raises(ConfigError, match="^base: unknown setting"):  # merging is fine; the stray section is not
        load_config(path)
    path.write_text("train:\n  <<: {steps: 50, log_every: 1}\n  steps: 70\n")
    assert load_config(path).train.steps == 70


@pytest.mark.parametrize("name, message", [
    ("a" * 129, "run.name: is 129 characters; use at most 128"),
    ("run\x00one", "run.name: holds a control character"),
    ("line\nbreak", "run.name: holds a control character"),
])
def test_run_names_that_cannot_be_folders_are_refused(name: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "name.yaml"
    path.write_text(yaml.safe_dump({"run": {"name": name}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_metrics_ports_past_the_range_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^metrics.port=65535: the 2 workers of a node serve on ports 65535 to "
                                          r"65536, beyond 65535; use a port at most 65534$"):
        load_config(None, ["metrics.port=65535"])
    assert load_config(None, ["metrics.port=65534"]).metrics.port == 65534
    assert load_config(None, ["metrics.port=65535", "scaling.num_workers=1"]).metrics.port == 65535


REPLICAS = ("fault_tolerance.mode=replica", "scaling.num_workers=4", "parallel.strategy=hybrid_shard",
            "parallel.shard=2", "train.global_batch_size=8", "train.micro_batch_size=2")


@pytest.mark.parametrize("overrides, message", [
    (("parallel.shard=4",), r"^fault_tolerance.mode=replica needs at least 2 replica groups: scaling.num_workers=4 "
                            r"over groups of 4 workers \(parallel.pipeline x shard x context x tensor\) makes 1; "),
    (("parallel.strategy=full_shard", "parallel.shard=auto"),
     r"^fault_tolerance.mode=replica replaces whole model copies, .* parallel.strategy=full_shard has none"),
    (("parallel.shard=auto",), r"^fault_tolerance.mode=replica needs the size of a replica group: set parallel.shard"),
    (("fault_tolerance.min_replicas=3",), r"^fault_tolerance.min_replicas=3 exceeds the run's 2 replica groups; use 1..2$"),
    (("fault_tolerance.heartbeat_timeout_s=0",), r"^fault_tolerance.heartbeat_timeout_s: .*greater than 0"),
    (("fault_tolerance.heartbeat_timeout_s=-1",), r"^fault_tolerance.heartbeat_timeout_s: .*greater than 0"),
    (("scaling.min_workers=2",), r"^scaling.min_workers \(elastic worker groups\) and fault_tolerance.mode=replica"),
    (("scaling.num_workers=6", "train.global_batch_size=12"),
     r"^fault_tolerance.data=strict splits each step over the live replica groups; with 2 of 3 live: "),
    # A hung group heartbeats until its watchdog ends it: the others' quorum must outlast that.
    (("fault_tolerance.quorum_timeout_s=120",),
     r"^fault_tolerance.quorum_timeout_s=120 does not outlast a hung replica group, .*\(run.hang_timeout_s=600 \+ 5 s \+ "
     r"fault_tolerance.heartbeat_timeout_s=5\).*raise fault_tolerance.quorum_timeout_s above 610, or lower run.hang_timeout_s$"),
    (("fault_tolerance.quorum_timeout_s=120", "run.hang_timeout_s=120"), r"above 130, "),
])
def test_replica_mode_settings_that_cannot_work_are_one_line(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*REPLICAS, *overrides])


def test_replica_only_settings_changed_in_restart_mode_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^fault_tolerance.min_replicas=2: read only in fault_tolerance.mode=replica, "
                                          r"and the mode is restart; set fault_tolerance.mode=replica, or drop it$"):
        load_config(None, ["fault_tolerance.min_replicas=2"])
    with pytest.raises(ConfigError, match=r"^fault_tolerance.data=fast, fault_tolerance.timeout_s=30.0: .* drop them$"):
        load_config(None, ["fault_tolerance.mode=restart", "fault_tolerance.data=fast", "fault_tolerance.timeout_s=30"])
    # At its default a setting changes nothing: a printed or saved config, which names every setting, loads.
    assert load_config(None, ["fault_tolerance.min_replicas=1", "fault_tolerance.data=strict"]).fault_tolerance.mode == "restart"


def test_replica_mode_counts_its_groups_and_needs_the_ft_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    cfg = load_config(None, [*REPLICAS, f"run.storage_path={tmp_path}"])
    assert cfg.replica_groups() == 2
    # The quorum may wait as long as it likes with no watchdog, or one that ends a hung group in time.
    for hangs in (["run.hang_timeout_s=null"], ["run.hang_timeout_s=100", "fault_tolerance.quorum_timeout_s=111"]):
        assert load_config(None, [*REPLICAS, "fault_tolerance.quorum_timeout_s=111", *hangs]).replica_groups() == 2
    assert load_config(None, [*REPLICAS, "scaling.num_workers=6", "train.global_batch_size=12",
                              "fault_tolerance.data=fast"]).replica_groups() == 3
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^fault_tolerance.mode=replica needs torchft: pip install -e '.\[ft\]', "
                                           r"or set fault_tolerance.mode=restart$"):
        preflight(cfg)
