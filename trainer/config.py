"""Recipes: YAML over typed dataclasses, with `key.sub=value` overrides (lingua style).

`load_config(["recipe=NAME", "train.max_steps=4"])` merges, in order: dataclass defaults,
`recipes/<name>.yaml`, dotted overrides. Unknown or mistyped keys exit with the key named and the
closest valid one.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from drafthead import options
from drafthead.trainer.regenerate import ANSWER_ENGINES
from drafthead.hardware import DTYPES

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
# the embedded default; `recipe=default` names it too. A name, not a symlink: wheels copy links as files.
DEFAULT_RECIPE = "eagle3_smollm2"


@dataclass
class TargetConfig:
    name_or_path: str = "smollm2-135m-instruct"  # built-in name, HF dir / hub id, or a .gguf path
    gguf_file: str | None = None  # the .gguf file inside name_or_path, when it is a folder or hub id holding several
    dtype: str = "auto"  # auto = bf16 where native (CUDA, AMX / AVX512-BF16 CPUs), fp32 elsewhere
    allow_mismatch: bool = False  # resume a checkpoint written against a target with another fingerprint
    # (the same model in another format, say); the mismatch is still printed
    tensor_parallel: int = 1  # ranks one target is split over (transformers' tp_plan); the draft trains
    # data-parallel across the world / tensor_parallel groups (docs/training.md, scaling out)


@dataclass
class RegenerateConfig:
    enabled: bool = False  # the target answers the training prompts itself (docs/data.md, target-written answers)
    fraction: float = 1.0  # share of training conversations whose answers the target rewrites
    max_new_tokens: int = 512  # longest answer written, in tokens
    temperature: float = 0.0  # 0 = greedy answers
    top_p: float = 1.0  # nucleus sampling of the answers when temperature > 0
    batch_size: int = 8  # conversations answered together
    max_turns: int = 1  # user turns answered, in order, each with the regenerated history
    max_prompt_tokens: int | None = None  # longer first prompts keep their original answers (null =
    # data.max_length - 32)
    heldout: bool = False  # also answer the held-out prompts with the target: held-out accuracy then scores
    # what drafting meets at inference (the target's own text) instead of the dataset's answers

    # who answers: vllm (vLLM's offline batched engine, scripts/make_vllm_env.sh) | ours (our batched AR loop) |
    # hf (transformers generate) | auto (ours where it runs the architecture, else vLLM where it works, else hf)
    engine: str = "auto"
    vllm_python: str | None = None  # vLLM's interpreter (default: the one scripts/make_vllm_env.sh made)


@dataclass
class DataConfig:
    dataset: str = "sharegpt"  # built-in name or a .json/.jsonl path (ShareGPT or OpenAI messages)
    max_samples: int | None = None  # cap on training conversations (null = all); num_holdout more are read
    max_length: int = 1024  # tokens per training conversation (longer ones: see overlong)
    overlong: str = "truncate"  # truncate | skip
    num_holdout: int = 64  # held-out conversations for eval (fixed seed)
    split_seed: int = 1234  # seed of the train / held-out split
    chat_template: str | None = None  # override the tokenizer's template (Jinja string)
    enable_thinking: bool | None = None  # Qwen3 templates
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)


@dataclass
class CaptureConfig:
    mode: str = "online"  # online (in the training step) | offline (sharded safetensors, then train)
    dir: str | None = None  # offline shards; default <output_dir>/capture
    layer_ids: list[int] | None = None  # aux layers (inputs of these decoder layers); null = [2, N//2, N-3]
    dtype: str = "bfloat16"  # storage / transfer dtype of captured features
    shard_samples: int = 256  # conversations per shard
    batch_tokens: int = 4096  # tokens per target forward while capturing


def _drafter_config() -> type:
    """`drafter.family` + one section per registered family (`drafter.<family>.*`, its options dataclass)."""
    from drafthead.registry import FAMILIES

    sections = [(name, fam.options, field(default_factory=fam.options)) for name, fam in FAMILIES.items()]
    family = field(default=next(iter(FAMILIES)), metadata={"help": f"the drafter family: {' | '.join(FAMILIES)}"})
    return make_dataclass("DrafterConfig", [("family", str, family), *sections])


DrafterConfig = _drafter_config()


@dataclass
class TrainConfig:
    epochs: float | None = None  # passes over the training data; null = 1, or the budget's plan
    max_steps: int | None = None  # null = by epochs
    batch_size: int = 1  # conversations per micro-batch per rank
    batch_tokens: int | None = None  # if set, micro-batches are packed up to this many (padded) tokens
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-4  # AdamW peak learning rate
    min_lr_ratio: float = 0.0  # the cosine schedule ends at lr * this
    warmup_ratio: float = 0.015  # share of the steps spent warming up linearly
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 0.5  # max gradient norm (0 = off)
    loss: str | None = None  # kl | lk_alpha | lk_hybrid | tv (docs/training.md, losses); null = the family's own
    # (kl, or DSpark's CE / TV mix)
    lk_eta: float = 3.0  # lk_hybrid: lambda = lk_kl_scale * exp(-lk_eta * alpha), per position
    lk_kl_scale: float = 1.0  # lk_hybrid: lambda where the draft accepts nothing, in (0, 1]
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    dtype: str = "auto"  # auto = bf16 where native (CUDA, AMX / AVX512-BF16 CPUs), fp32 elsewhere
    deepspeed: str | None = None  # null, a name under recipes/deepspeed/ (e.g. zero2) or a path
    save_every: int = 500  # steps
    keep_checkpoints: int = 2  # newest checkpoints kept (older ones are deleted after each save)
    eval_every: int = 200  # steps; 0 = only at the end
    eval_samples: int | None = None  # held-out conversations per eval (null = all held out)
    resume: str = "auto"  # auto | true | false
    stop_after_steps: int | None = None  # leave after N optimizer steps in this process (preemptible queues)
    num_threads: int | None = None  # torch CPU threads per rank (null = torch default)
    dry_run: bool = False  # print the memory per rank from the target's config and exit (no weights loaded)

    # after the final save, time our runtime on a held-out prompt and record the draft length with the best
    # expected speedup in final/config.json "serving" (one-process runs on a runtime-supported target; seconds)
    choose_serving: bool = True


@dataclass
class BudgetConfig:
    minutes: float | None = None  # wall clock for the whole run; null = off. With a budget, the run measures
    # this machine first and fills data.max_samples / train.epochs where they are null (trainer/budget.py)
    max_passes: float = 4.0  # most passes over captured data a plan makes (the held-out curve flattens in the 4th)
    probe_samples: int = 512  # conversations tokenized by the probe: tokens per sample and usable share
    # (a few hundred: ShareGPT's lengths vary too much for fewer to estimate them)
    probe_batches: int = 3  # batches timed per phase (after one warm-up)


@dataclass
class LoggingConfig:
    wandb: bool = True  # offline unless WANDB_API_KEY is set
    project: str = "drafthead"  # the wandb project
    log_every: int = 10  # steps between metric lines (metrics.jsonl, wandb)
    progress: bool = True  # progress bars


@dataclass
class RunConfig:
    recipe: str = DEFAULT_RECIPE  # a name under recipes/ or a .yaml path (a run's config.yaml resumes it)
    output_dir: str | None = None  # null = runs/<recipe>
    seed: int = 0  # seeds the draft's init, the batch order and sampling
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


class ConfigError(ValueError):
    pass


def recipe_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    p = RECIPES_DIR / f"{DEFAULT_RECIPE if name == 'default' else name}.yaml"
    if not p.is_file():
        known = sorted(q.stem for q in RECIPES_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown recipe '{name}'; known recipes: {', '.join(known)}")
    return p


def load_config(argv: list[str] | None = None) -> RunConfig:
    """Defaults <- recipes/<recipe>.yaml <- `key=value` overrides; strict about unknown keys."""
    pairs = options.key_values(list(argv or []), ConfigError)
    recipe = pairs.pop("recipe", DEFAULT_RECIPE)
    file_cfg = OmegaConf.load(recipe_path(recipe))
    cfg: RunConfig = options.parse(RunConfig, pairs, ConfigError, layers=(file_cfg,))
    if not (recipe.endswith((".yaml", ".yml")) and "recipe" in file_cfg):  # a run's config.yaml keeps its name
        cfg.recipe = Path(recipe).stem if recipe.endswith((".yaml", ".yml")) else recipe
    cfg.output_dir = cfg.output_dir or f"runs/{cfg.recipe}"
    validate(cfg)
    _other_family_keys(pairs, cfg.drafter.family)
    return cfg


def _other_family_keys(pairs: dict[str, Any], family: str) -> None:
    """A typed `drafter.<F>.*` key for a family F the run does not train would be read by nothing (every family's
    section exists in the schema, so the parse takes it): name it instead of training something else quietly."""
    from drafthead.registry import FAMILIES

    for key in pairs:
        parts = key.split(".")
        if len(parts) > 2 and parts[0] == "drafter" and parts[1] in FAMILIES and parts[1] != family:
            raise ConfigError(f"'{key}' is an option of the {parts[1]} drafter, but this run trains "
                              f"drafter.family={family}: set drafter.family={parts[1]} (or a {parts[1]} recipe), "
                              f"or drop the key")


def help_text(argv: list[str], entry: str = "drafthead train") -> str:
    """Every option with the value the recipe named in `argv` (default: the embedded default) gives it; `entry`:
    the command the user typed."""
    pairs = options.key_values(list(argv), ConfigError)
    cfg = options.parse(RunConfig, {k: v for k, v in pairs.items() if k != "recipe"}, ConfigError,
                        layers=(OmegaConf.load(recipe_path(pairs.get("recipe", DEFAULT_RECIPE))),))
    recipes = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    return options.help_text(f"{entry} [recipe=NAME] key.sub=value ...", __doc__, cfg,
                             f"values shown: recipe={pairs.get('recipe', DEFAULT_RECIPE)} with the keys given. "
                             f"Recipes: {', '.join(recipes)}, or a .yaml path.")


def validate(cfg: RunConfig) -> None:
    choices = {"capture.mode": (cfg.capture.mode, ("online", "offline")),
               "data.regenerate.engine": (cfg.data.regenerate.engine, ANSWER_ENGINES),
               "data.overlong": (cfg.data.overlong, ("truncate", "skip")),
               "train.resume": (str(cfg.train.resume).lower(), ("auto", "true", "false"))}
    for key, (val, ok) in choices.items():
        if val not in ok:
            raise ConfigError(f"bad value for '{key}': {val!r} (choose from {', '.join(ok)})")
    for key, val in (("target.dtype", cfg.target.dtype), ("train.dtype", cfg.train.dtype)):
        if val not in DTYPES:
            raise ConfigError(f"bad value for '{key}': {val!r} (choose from {', '.join(DTYPES)})")
    if cfg.train.epochs is not None and cfg.train.epochs <= 0:
        raise ConfigError(f"bad value for 'train.epochs': {cfg.train.epochs} (must be > 0 or null)")
    b = cfg.budget
    if b.minutes is not None and b.minutes <= 0:
        raise ConfigError(f"bad value for 'budget.minutes': {b.minutes} (must be > 0, or null for no budget)")
    if b.max_passes < 1:
        raise ConfigError(f"bad value for 'budget.max_passes': {b.max_passes} (must be >= 1)")
    if b.probe_samples < 8:
        raise ConfigError(f"bad value for 'budget.probe_samples': {b.probe_samples} (must be >= 8)")
    if b.probe_batches < 1:
        raise ConfigError(f"bad value for 'budget.probe_batches': {b.probe_batches} (must be >= 1)")
    if cfg.data.max_samples is not None and cfg.data.max_samples < 1:
        raise ConfigError(f"bad value for 'data.max_samples': {cfg.data.max_samples} (must be >= 1 or null)")
    if cfg.data.max_length < 8:
        raise ConfigError(f"bad value for 'data.max_length': {cfg.data.max_length} (must be >= 8)")
    for key, val, ok, rule in _range_checks(cfg):
        if val is not None and not ok(val):
            raise ConfigError(f"bad value for '{key}': {val} (must be {rule})")
    if cfg.train.deepspeed:
        deepspeed_config_path(cfg.train.deepspeed)  # a name or file that does not exist fails here
        from drafthead.optional import hint, installed

        if not installed("deepspeed"):  # an optional extra: say so now, not after the target has loaded
            raise ConfigError(f"train.deepspeed={cfg.train.deepspeed} needs DeepSpeed, which is not installed here: "
                              f"{hint('deepspeed')}, or train.deepspeed=null (plain / DDP)")
    _tensor_parallel_checks(cfg)
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"bad value for 'output_dir': {out} exists and is not a directory")
    if cfg.capture.dir and Path(cfg.capture.dir).exists() and not Path(cfg.capture.dir).is_dir():
        raise ConfigError(f"bad value for 'capture.dir': {cfg.capture.dir} exists and is not a directory")
    from drafthead.registry import FAMILIES

    dc = cfg.drafter
    if dc.family not in FAMILIES:
        raise ConfigError(f"bad value for 'drafter.family': {dc.family!r} (choose from {', '.join(FAMILIES)})")
    losses = FAMILIES[dc.family].losses
    if cfg.train.loss is not None and cfg.train.loss not in losses:
        takes = f"takes {', '.join(losses)} or null" if losses else "trains its own loss only: leave it null"
        raise ConfigError(f"bad value for 'train.loss': {cfg.train.loss!r} (drafter.family={dc.family} {takes})")
    try:
        getattr(dc, dc.family).validate()
    except ValueError as e:  # "<key>: <why>" from the family's options
        key, _, why = str(e).partition(": ")
        raise ConfigError(f"bad value for 'drafter.{dc.family}.{key}': {why}") from None


def _tensor_parallel_checks(cfg: RunConfig) -> None:
    """What a split target cannot do yet, named at parse: each of these runs the target on rank 0 alone, or
    hands its weights to an engine that does not know the split."""
    tp = cfg.target.tensor_parallel
    if tp == 1:
        return
    why = {"target.gguf_file": cfg.target.gguf_file or str(cfg.target.name_or_path).endswith(".gguf"),
           "budget.minutes": cfg.budget.minutes is not None,
           "data.regenerate.enabled": cfg.data.regenerate.enabled,
           "train.deepspeed": bool(cfg.train.deepspeed),
           "drafter.family=lora": cfg.drafter.family == "lora"}
    notes = {"target.gguf_file": "a GGUF target loads on one rank; use the HF checkpoint",
             "budget.minutes": "the time budget measures the target on rank 0 alone; set data.max_samples and "
                               "train.epochs, budget.minutes=null",
             "data.regenerate.enabled": "regeneration decodes on rank 0 alone; regenerate once with an engine "
                                        "(SGLang / vLLM) or in a run without tensor parallelism",
             "train.deepspeed": "DeepSpeed would shard the draft over the whole world, not the data-parallel "
                                "groups; use train.deepspeed=null (DDP)",
             "drafter.family=lora": "a LoRA self-draft runs the target's own first layers"}
    bad = [k for k, v in why.items() if v]
    if bad:
        raise ConfigError(f"target.tensor_parallel={tp} cannot be combined with {bad[0]}: {notes[bad[0]]}")


def _range_checks(cfg: RunConfig) -> list[tuple[str, Any, Any, str]]:
    """(key, value, predicate, rule) for every numeric option: checked when the recipe is parsed, so a bad
    value is one line naming its key before the target, the data or the drafter load. None = null, allowed."""
    t, d, r, c, lg = cfg.train, cfg.data, cfg.data.regenerate, cfg.capture, cfg.logging
    pos = (lambda v: v >= 1, ">= 1")
    nonneg = (lambda v: v >= 0, ">= 0")
    unit = (lambda v: 0 <= v < 1, "in [0, 1)")
    checks = [("target.tensor_parallel", cfg.target.tensor_parallel, *pos),
              ("train.batch_size", t.batch_size, *pos), ("train.grad_accum", t.grad_accum, *pos),
              ("train.max_steps", t.max_steps, *pos), ("train.batch_tokens", t.batch_tokens, *pos),
              ("train.lr", t.lr, lambda v: v > 0 and math.isfinite(v), "> 0"),
              ("train.min_lr_ratio", t.min_lr_ratio, lambda v: 0 <= v <= 1, "in [0, 1]"),
              ("train.warmup_ratio", t.warmup_ratio, *unit), ("train.weight_decay", t.weight_decay, *nonneg),
              ("train.grad_clip", t.grad_clip, *nonneg), ("train.save_every", t.save_every, *nonneg),
              ("train.keep_checkpoints", t.keep_checkpoints, *pos), ("train.eval_every", t.eval_every, *nonneg),
              ("train.eval_samples", t.eval_samples, *pos), ("train.stop_after_steps", t.stop_after_steps, *pos),
              ("train.num_threads", t.num_threads, *pos),
              ("train.lk_eta", t.lk_eta, *nonneg),
              ("train.lk_kl_scale", t.lk_kl_scale, lambda v: 0 < v <= 1, "in (0, 1]"),
              ("train.betas", t.betas, lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1)"),
              ("data.num_holdout", d.num_holdout, *nonneg),
              ("data.regenerate.fraction", r.fraction, lambda v: 0 < v <= 1, "in (0, 1]"),
              ("data.regenerate.max_new_tokens", r.max_new_tokens, *pos),
              ("data.regenerate.temperature", r.temperature, *nonneg),
              ("data.regenerate.top_p", r.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
              ("data.regenerate.batch_size", r.batch_size, *pos), ("data.regenerate.max_turns", r.max_turns, *pos),
              ("data.regenerate.max_prompt_tokens", r.max_prompt_tokens, *pos),
              ("capture.shard_samples", c.shard_samples, *pos), ("capture.batch_tokens", c.batch_tokens, *pos),
              ("capture.dtype", c.dtype, lambda v: v in CAPTURE_DTYPES, f"one of {', '.join(CAPTURE_DTYPES)}"),
              ("capture.layer_ids", c.layer_ids, lambda v: len(v) > 0 and all(i >= 0 for i in v),
               "a non-empty list of layer ids >= 0, or null"),
              ("logging.log_every", lg.log_every, *pos)]
    return checks


CAPTURE_DTYPES = ("bfloat16", "float16", "float32")


def deepspeed_config_path(name: str) -> Path:
    """`train.deepspeed`: a JSON file, or a built-in name under recipes/deepspeed/."""
    p = Path(name)
    if p.is_file():
        return p
    p = RECIPES_DIR / "deepspeed" / f"{name}.json"
    if not p.is_file():
        known = sorted(q.stem for q in (RECIPES_DIR / "deepspeed").glob("*.json"))
        raise ConfigError(f"bad value for 'train.deepspeed': {name!r} is neither a file nor a built-in config "
                          f"(known: {', '.join(known)})")
    return p


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def parse_or_exit(argv: list[str]) -> RunConfig:
    try:
        return load_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def as_dict(cfg: Any) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
