"""Fit a latency profile to measured GPU operator timings from Vidur's profiler.

The built-in A10 profiles are arithmetic on datasheet figures; this module lets the simulator's
step times rest on measurements instead. Vidur (microsoft/vidur) times each operator of one
transformer layer on a real GPU: ``mlp.csv`` holds the layer's non-attention operators by token
count, ``attention.csv`` its attention by prefill chunk, batch size and KV cache length. As
Vidur's own ``ExecutionTime`` does, one forward pass is the layer's operators times the number of
layers; we add what Vidur leaves out and a real step pays:

    step = cpu_overhead + emb(tokens) + lm_head(sequences) + layers * (ops(tokens) + attention(row))

``emb`` is measured (the table's ``emb`` column); ``lm_head`` (the vocabulary projection, run for
the last token of each sequence) is not profiled, so it is the measured fused gate+up GEMM scaled
by the ratio of output widths (same input width, same rows); ``cpu_overhead`` (scheduling, input
preparation, sampling) is an assumption. Each attention row then gives one measured step: a
prefill row (batch 1, empty KV cache, chunk = the whole prompt) a prefill of that many tokens, a
decode row one decode step of ``batch_size`` sequences of ``kv_cache_size`` tokens each. The
profile's coefficients are the non-negative least-squares fit of those steps in relative error
(prompts from 32 to 4,096 tokens span 20x in time; absolute error would ignore short ones).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import lzma
import math
from dataclasses import asdict, dataclass
from itertools import combinations
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import numpy as np

from llumdask.engine.headroom import with_headroom
from llumdask.engine.latency import DecodeCost, LatencyProfile, PrefillCost

# Vidur's tables hold milliseconds.
_MS = 1e-3
_STAT = "median"  # robust to the odd slow repetition within a row
# The layer's operators outside attention, by token count (mlp.csv); Vidur counts one residual add.
LAYER_OPS = (
    "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
    "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add",
)
# Attention's operators (attention.csv); those that do not apply to a row are 0 there.
ATTENTION_OPS = ("attn_input_reshape", "attn_kv_cache_save", "attn_prefill", "attn_decode", "attn_output_reshape")
_SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp", "num_tensor_parallel_workers")
_ATTENTION_COLUMNS = ("batch_size", "prefill_chunk_size", "kv_cache_size", "is_prefill", "block_size", "n_q_head", "n_kv_head", "n_embd")
_DTYPE_BYTES = 2  # fp16 / bf16 weights and KV cache, as profiled
# Weights + KV cache of the LLaMA-7B A10 profile (13,476,831,232 B + 13,616 x 524,288 B): the default
# memory for weights + KV of another 24 GB card, so that the profiles share one activation reserve.
DEFAULT_MEMORY_BYTES = 20_615_536_640
# No fixed CPU cost per step by default: vLLM v1 prepares the next step while the GPU runs this one.
DEFAULT_CPU_OVERHEAD_S = 0.0
HOLDOUT_EVERY = 5  # the held-out check predicts every 5th sample from a fit to the others


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions the tables were profiled with (their constant columns)."""

    hidden: int
    q_heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.q_heads

    def kv_bytes_per_token(self, layers: int) -> int:
        """K and V of every layer, for the KV heads only (grouped-query attention)."""
        return 2 * layers * self.kv_heads * self.head_dim * _DTYPE_BYTES

    @property
    def up_proj_width(self) -> int:
        """Output width of the profiled ``mlp_up_proj`` GEMM: Vidur fuses gate and up when gated."""
        return 2 * self.intermediate if self.gated_mlp else self.intermediate


@dataclass(frozen=True)
class KnownModel:
    name: str
    layers: int
    parameters: int
    source: str


# Shapes whose layer count and size the tables cannot tell (they profile one layer).
KNOWN_MODELS: Mapping[ModelShape, KnownModel] = MappingProxyType({
    ModelShape(hidden=3584, q_heads=28, kv_heads=4, intermediate=18944, vocab=151936, gated_mlp=True): KnownModel(
        "Qwen2-7B", layers=28, parameters=7_615_616_512,
        source="Qwen2-7B config.json: 28 layers, vocab 152,064 (padded), untied embeddings, QKV biases",
    ),
})


@dataclass(frozen=True)
class VidurTables:
    """Median operator times in seconds, NaN where a value is missing or was filtered out."""

    shape: ModelShape
    block_size: int
    tokens: np.ndarray  # mlp.csv num_tokens
    layer_ops: Mapping[str, np.ndarray]  # op -> seconds per mlp.csv row
    dropped: Mapping[str, int]  # op -> how many mlp.csv values were missing or implausible
    attention: Mapping[str, np.ndarray]  # key columns and attention seconds (sum of ATTENTION_OPS) per row
    digests: Mapping[str, str]  # file name -> sha256


@dataclass(frozen=True)
class Samples:
    """Measured step times and their design rows [1, x, y] for one cost formula."""

    design: np.ndarray  # (n, 3)
    seconds: np.ndarray  # (n,)

    def __post_init__(self) -> None:
        if self.design.ndim != 2 or self.design.shape != (len(self.seconds), 3):
            raise ValueError(f"samples need a (n, 3) design for n times, got {self.design.shape} for {len(self.seconds)}")

    def __len__(self) -> int:
        return len(self.seconds)

    def take(self, mask: np.ndarray) -> "Samples":
        return Samples(self.design[mask], self.seconds[mask])


@dataclass(frozen=True)
class FitQuality:
    """Relative errors of the fitted formula against the measured steps."""

    samples: int
    mean_error: float
    max_error: float
    holdout_max_error: float  # every HOLDOUT_EVERY-th sample predicted by a fit to the others

    def describe(self) -> str:
        return (f"{self.samples} measured steps, mean |error| {self.mean_error:.1%}, max {self.max_error:.1%}, "
                f"held-out max {self.holdout_max_error:.1%}")


@dataclass(frozen=True)
class FitOptions:
    """What the tables do not say. None for layers/parameters: look the shape up in KNOWN_MODELS."""

    name: str
    layers: int | None = None
    parameters: int | None = None
    memory_bytes: int = DEFAULT_MEMORY_BYTES  # device memory for weights + KV cache
    cpu_overhead_s: float = DEFAULT_CPU_OVERHEAD_S
    device: str | None = None


@dataclass(frozen=True)
class FitResult:
    """The fitted profile and how closely its formulas follow the measured steps."""

    profile: LatencyProfile
    prefill: FitQuality
    decode: FitQuality


# ------------------------------------------------------------------------------------ reading
def read_vidur_tables(directory: str | Path) -> VidurTables:
    """Read mlp.csv and attention.csv (plain or .xz) and drop the values that cannot be right."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"Vidur data folder {str(folder)!r} does not exist")
    digests: dict[str, str] = {}
    mlp = _read_table(folder, "mlp", digests)
    attn = _read_table(folder, "attention", digests)
    shape = _model_shape(mlp)
    _require_same(attn, {"n_q_head": shape.q_heads, "n_kv_head": shape.kv_heads, "n_embd": shape.hidden}, "attention")

    layer_ops = {op: _times(mlp, op) for op in LAYER_OPS + ("emb",)}
    missing = {op: int(np.isnan(t).sum()) for op, t in layer_ops.items()}
    # The fused QKV GEMM cannot beat an elementwise add over the same tokens: such values time nothing.
    implausible = layer_ops["attn_pre_proj"] < layer_ops["add"]
    layer_ops["attn_pre_proj"] = np.where(implausible, np.nan, layer_ops["attn_pre_proj"])
    dropped = {op: missing[op] + (int(implausible.sum()) if op == "attn_pre_proj" else 0) for op in layer_ops}

    attention = {key: _ints(attn, key, "attention") for key in ("batch_size", "prefill_chunk_size", "kv_cache_size")}
    attention["is_prefill"] = np.array([_bool(v, "attention", "is_prefill") for v in attn["is_prefill"]])
    attention["seconds"] = sum(_times(attn, op) for op in ATTENTION_OPS)
    block_sizes = set(attn["block_size"])
    if len(block_sizes) != 1:
        raise ValueError(f"attention table: expected one block_size, found {sorted(block_sizes)}")
    return VidurTables(
        shape=shape,
        block_size=int(block_sizes.pop()),
        tokens=_ints(mlp, "num_tokens", "mlp"),
        layer_ops=MappingProxyType(layer_ops),
        dropped=MappingProxyType(dropped),
        attention=MappingProxyType(attention),
        digests=MappingProxyType(digests),
    )


def _read_table(folder: Path, stem: str, digests: dict[str, str]) -> dict[str, list[str]]:
    """Columns of `<stem>.csv` or `<stem>.csv.xz`, checked for the columns this module reads."""
    for path in (folder / f"{stem}.csv.xz", folder / f"{stem}.csv"):
        if path.is_file():
            break
    else:
        raise ValueError(f"Vidur data folder {str(folder)!r} has no {stem}.csv or {stem}.csv.xz")
    raw = path.read_bytes()
    digests[path.name] = hashlib.sha256(raw).hexdigest()
    text = (lzma.decompress(raw) if path.suffix == ".xz" else raw).decode()
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ValueError(f"{path.name}: no rows")
    ops = LAYER_OPS + ("emb",) if stem == "mlp" else ATTENTION_OPS
    keys = ("num_tokens",) + _SHAPE_COLUMNS if stem == "mlp" else _ATTENTION_COLUMNS
    needed = [f"time_stats.{op}.{_STAT}" for op in ops] + list(keys)
    absent = [c for c in needed if c not in rows[0]]
    if absent:
        raise ValueError(f"{path.name}: missing columns {absent}")
    return {c: [row[c] for row in rows] for c in needed}


def _model_shape(mlp: dict[str, list[str]]) -> ModelShape:
    constants = {}
    for column in _SHAPE_COLUMNS:
        values = set(mlp[column])
        if len(values) != 1:
            raise ValueError(f"mlp table: column {column!r} must hold one value, found {sorted(values)}")
        constants[column] = values.pop()
    workers = int(constants["num_tensor_parallel_workers"])
    if workers != 1:
        raise ValueError(f"mlp table: profiled with {workers} tensor-parallel workers; only single-GPU tables (1) are supported")
    return ModelShape(
        hidden=int(constants["n_embd"]),
        q_heads=int(constants["n_head"]),
        kv_heads=int(constants["n_kv_head"]),
        intermediate=int(constants["n_expanded_embd"]),
        vocab=int(constants["vocab_size"]),
        gated_mlp=_bool(constants["use_gated_mlp"], "mlp", "use_gated_mlp"),
    )


def _require_same(table: dict[str, list[str]], expected: Mapping[str, int], name: str) -> None:
    for column, value in expected.items():
        found = set(table[column])
        if found != {str(value)}:
            raise ValueError(f"{name} table: column {column!r} holds {sorted(found)}, the mlp table says {value}")


def _times(table: dict[str, list[str]], op: str) -> np.ndarray:
    """Seconds; empty cells and 'nan' become NaN."""
    return np.array([float(v) if v.strip() else math.nan for v in table[f"time_stats.{op}.{_STAT}"]]) * _MS


def _ints(table: dict[str, list[str]], column: str, name: str) -> np.ndarray:
    try:
        return np.array([int(v) for v in table[column]], dtype=np.int64)
    except ValueError as exc:
        raise ValueError(f"{name} table: column {column!r} must hold integers ({exc})") from None


def _bool(text: str, name: str, column: str) -> bool:
    if text not in ("True", "False"):
        raise ValueError(f"{name} table: column {column!r} must hold True or False, got {text!r}")
    return text == "True"


# ------------------------------------------------------------------------------------ steps
def layer_op_time(tables: VidurTables, op: str, tokens: np.ndarray) -> np.ndarray:
    """One operator's seconds at these token counts: piecewise linear through its valid measurements,
    extended linearly past the largest (a GEMM's time grows linearly there), flat below the smallest."""
    valid = ~np.isnan(tables.layer_ops[op])
    if valid.sum() < 2:
        raise ValueError(f"mlp table: operator {op!r} has {int(valid.sum())} usable values, need at least 2")
    xs, inverse = np.unique(tables.tokens[valid], return_inverse=True)
    ys = np.bincount(inverse, weights=tables.layer_ops[op][valid]) / np.bincount(inverse)  # mean of repeats
    x = np.asarray(tokens, dtype=float)
    y = np.interp(x, xs, ys)
    beyond = x > xs[-1]
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return np.where(beyond, ys[-1] + (x - xs[-1]) * slope, y)


def step_seconds(tables: VidurTables, layers: int, cpu_overhead_s: float,
                 tokens: np.ndarray, sequences: np.ndarray, attention_s: np.ndarray) -> np.ndarray:
    """Measured forward passes: `tokens` through the layers, logits for `sequences` rows."""
    per_layer = sum(layer_op_time(tables, op, tokens) for op in LAYER_OPS) + attention_s
    lm_head = layer_op_time(tables, "mlp_up_proj", sequences) * (tables.shape.vocab / tables.shape.up_proj_width)
    return cpu_overhead_s + layer_op_time(tables, "emb", tokens) + lm_head + layers * per_layer


def prefill_samples(tables: VidurTables, layers: int, cpu_overhead_s: float) -> Samples:
    """One prompt prefilled whole: attention rows with batch 1 and an empty KV cache."""
    a = tables.attention
    rows = a["is_prefill"] & (a["kv_cache_size"] == 0) & (a["batch_size"] == 1)
    n = a["prefill_chunk_size"][rows]
    seconds = step_seconds(tables, layers, cpu_overhead_s, n, np.ones_like(n), a["seconds"][rows])
    return Samples(np.column_stack([np.ones(len(n)), n, n.astype(float) ** 2]), seconds)


def decode_samples(tables: VidurTables, layers: int, cpu_overhead_s: float) -> Samples:
    """One decode step of `batch_size` sequences holding `kv_cache_size` tokens each."""
    a = tables.attention
    rows = ~a["is_prefill"]
    batch = a["batch_size"][rows]
    context = batch * a["kv_cache_size"][rows]
    seconds = step_seconds(tables, layers, cpu_overhead_s, batch, batch, a["seconds"][rows])
    return Samples(np.column_stack([np.ones(len(batch)), batch, context]).astype(float), seconds)


# ------------------------------------------------------------------------------------ fitting
def fit_coefficients(samples: Samples) -> np.ndarray:
    """Non-negative least squares in relative error: the best of every subset of coefficients
    left free (the others 0) whose unconstrained solution is non-negative; exact for 3 terms."""
    if len(samples) < samples.design.shape[1]:
        raise ValueError(f"need at least {samples.design.shape[1]} measured steps to fit, got {len(samples)}")
    if np.any(samples.seconds <= 0) or not np.all(np.isfinite(samples.seconds)):
        raise ValueError("measured step times must be finite and positive")
    weighted = samples.design / samples.seconds[:, None]
    ones = np.ones(len(samples))
    terms = range(weighted.shape[1])
    best, best_residual = None, math.inf
    for size in range(1, weighted.shape[1] + 1):
        for free in combinations(terms, size):
            solution = np.linalg.lstsq(weighted[:, free], ones, rcond=None)[0]
            if np.any(solution < 0):
                continue
            coefficients = np.zeros(weighted.shape[1])
            coefficients[list(free)] = solution
            residual = float(np.sum((weighted @ coefficients - ones) ** 2))
            if residual < best_residual:
                best, best_residual = coefficients, residual
    assert best is not None  # a single column of positive entries always fits with a positive scale
    return best


def relative_errors(coefficients: np.ndarray, samples: Samples) -> np.ndarray:
    return (samples.design @ coefficients - samples.seconds) / samples.seconds


def fit_quality(coefficients: np.ndarray, samples: Samples) -> FitQuality:
    errors = np.abs(relative_errors(coefficients, samples))
    held_out = np.arange(len(samples)) % HOLDOUT_EVERY == 0
    holdout = np.abs(relative_errors(fit_coefficients(samples.take(~held_out)), samples.take(held_out)))
    return FitQuality(len(samples), float(errors.mean()), float(errors.max()), float(holdout.max()))


# ------------------------------------------------------------------------------------ profile
def fit_vidur(directory: str | Path, options: FitOptions) -> FitResult:
    """The profile fitted to the Vidur tables in `directory`, with its fit errors."""
    if options.cpu_overhead_s < 0 or not math.isfinite(options.cpu_overhead_s):
        raise ValueError(f"cpu overhead must be a finite number >= 0 seconds, got {options.cpu_overhead_s!r}")
    tables = read_vidur_tables(directory)
    size = _model_size(tables.shape, options)
    prefill = prefill_samples(tables, size.layers, options.cpu_overhead_s)
    decode = decode_samples(tables, size.layers, options.cpu_overhead_s)
    p, d = fit_coefficients(prefill), fit_coefficients(decode)
    weight_bytes = size.parameters * _DTYPE_BYTES
    block = tables.block_size
    capacity = int((options.memory_bytes - weight_bytes) // tables.shape.kv_bytes_per_token(size.layers) // block * block)
    if capacity < block:
        raise ValueError(f"memory {options.memory_bytes:,} B leaves no room for KV blocks after {weight_bytes:,} B of weights")
    quality = (fit_quality(p, prefill), fit_quality(d, decode))
    prefill_cost, decode_cost = PrefillCost(*map(_round, p)), DecodeCost(*map(_round, d))
    profile = LatencyProfile(
        name=options.name,
        capacity_tokens=capacity,
        block_size=block,
        model_kv_bytes_per_token=tables.shape.kv_bytes_per_token(size.layers),
        prefill=prefill_cost,
        decode=decode_cost,
        derivation="\n".join(_derivation(tables, options, size, capacity, prefill_cost, decode_cost, *quality)),
    )
    return FitResult(with_headroom(profile), *quality)


@dataclass(frozen=True)
class _ModelSize:
    model: str
    layers: int
    parameters: int
    source: str


def _model_size(shape: ModelShape, options: FitOptions) -> _ModelSize:
    known = KNOWN_MODELS.get(shape)
    layers = options.layers if options.layers is not None else (known.layers if known else None)
    parameters = options.parameters if options.parameters is not None else (known.parameters if known else None)
    if layers is None or parameters is None:
        raise ValueError(f"the tables' model shape {shape} is not a known model; pass the number of layers and parameters")
    if layers < 1 or parameters < 1:
        raise ValueError(f"layers ({layers}) and parameters ({parameters}) must be positive")
    given = options.layers is not None and options.parameters is not None
    return _ModelSize(
        model=known.name if known else "the profiled model",
        layers=layers,
        parameters=parameters,
        source="as given" if given or known is None else known.source,
    )


def _round(x: float) -> float:
    """Five significant digits, as the hand-derived profiles."""
    return float(f"{x:.5g}")


def profile_to_dict(profile: LatencyProfile) -> dict:
    """The JSON form `load_profile` reads, derivation as a list of lines."""
    return {
        "name": profile.name,
        "capacity_tokens": profile.capacity_tokens,
        "block_size": profile.block_size,
        "model_kv_bytes_per_token": profile.model_kv_bytes_per_token,
        "prefill": asdict(profile.prefill),
        "decode": asdict(profile.decode),
        "derivation": profile.derivation.split("\n"),
    } | ({} if profile.headroom is None else {"headroom": dict(profile.headroom)})


def profile_json(profile: LatencyProfile) -> str:
    return json.dumps(profile_to_dict(profile), indent=2) + "\n"


def _derivation(tables: VidurTables, options: FitOptions, size: _ModelSize, capacity: int,
                p: PrefillCost, d: DecodeCost, prefill: FitQuality, decode: FitQuality) -> list[str]:
    s = tables.shape
    device = options.device or "the GPU the tables were measured on"
    layers, parameters = size.layers, size.parameters
    weight_bytes = parameters * _DTYPE_BYTES
    kv = s.kv_bytes_per_token(layers)
    dropped = ", ".join(f"{op} {n}" for op, n in tables.dropped.items() if n) or "none"
    files = ", ".join(f"{name} (sha256 {digest[:16]})" for name, digest in sorted(tables.digests.items()))
    a = tables.attention
    whole = a["is_prefill"] & (a["kv_cache_size"] == 0)
    prompts, batches, lengths = a["prefill_chunk_size"][whole], a["batch_size"][~a["is_prefill"]], a["kv_cache_size"][~a["is_prefill"]]
    memory_source = (
        "the LLaMA-7B A10 profile's 13,476,831,232 B weights + 13,616 x 524,288 B KV, so that 24 GB cards share one "
        "activation and framework reserve" if options.memory_bytes == DEFAULT_MEMORY_BYTES else "as given")
    flags = "".join(
        f" {flag} {value}" for flag, value in (
            ("--layers", layers), ("--parameters", parameters), ("--memory-bytes", options.memory_bytes),
            ("--cpu-overhead-s", options.cpu_overhead_s)))
    return [
        f"{size.model} on {device}, fitted to measured GPU operator timings (Vidur profiler tables), not to datasheet figures.",
        f"Reproduce: llumdask profile fit-vidur --data DIR --out {options.name}.json{flags}"
        + (f" --device '{options.device}'" if options.device else "") + f", DIR holding {files}.",
        f"Tables' model shape: hidden {s.hidden}, {s.q_heads} query heads, {s.kv_heads} KV heads (head dim {s.head_dim}), "
        f"MLP {s.intermediate} ({'gated' if s.gated_mlp else 'plain'}), vocab {s.vocab}, one GPU, block {tables.block_size}; "
        f"{layers} layers and {parameters:,} parameters from outside the tables ({size.source}).",
        f"Times: the '{_STAT}' of each operator (milliseconds in the tables). Dropped as missing (NaN) or implausible "
        "(attn_pre_proj, the fused QKV GEMM, below the same row's elementwise add): " + dropped + " values of "
        f"{len(tables.tokens)} mlp.csv rows; each operator is interpolated linearly between its own remaining token counts "
        "(extrapolated linearly past its largest).",
        f"Forward pass = {options.cpu_overhead_s * 1e3:g} ms fixed CPU cost per step (the tables have no CPU profile; "
        "vLLM v1 schedules and prepares the next step while the GPU runs the current one, so by default none is charged) "
        "+ emb(tokens) + lm_head(sequences) "
        f"+ {layers} x (input_layernorm + attn_pre_proj + attn_rope + attention + attn_post_proj + post_attention_layernorm "
        "+ mlp_up_proj + mlp_act + mlp_down_proj + add), summed per layer as Vidur's ExecutionTime does.",
        f"lm_head is not profiled; it is the same GEMM as the measured mlp_up_proj ({s.hidden} inputs, the same rows) but "
        f"for its output width, {s.vocab} against {s.up_proj_width}: its time is mlp_up_proj's scaled by {s.vocab}/{s.up_proj_width}, "
        "which holds whether the GEMM is bound by reading its weights (few rows: lm_head runs for one token per sequence) "
        "or by its FLOPs (both grow with the output width).",
        f"Prefill: attention.csv rows with batch 1 and an empty KV cache (a whole prompt in one chunk) -> "
        f"a + b x tokens + c x tokens^2 with a = {p.base_s:g} s, b = {p.per_token_s:g} s, c = {p.per_token_squared_s:g} s; "
        f"{prefill.describe()}.",
        f"Decode: attention.csv decode rows (batch B of sequences holding L tokens each, context = B x L) -> "
        f"d + e x B + f x context with d = {d.base_s:g} s, e = {d.per_seq_s:g} s, f = {d.per_context_token_s:g} s; "
        f"{decode.describe()}.",
        "Fit: non-negative least squares of relative error, coefficients rounded to 5 significant digits; "
        f"held out = every {HOLDOUT_EVERY}th measured step, predicted by a fit to the others. "
        "Chunked-prefill rows (non-empty KV cache) are not used: the model has no chunked prefill.",
        f"KV cache per token: 2 x {layers} layers x {s.kv_heads} KV heads x {s.head_dim} x {_DTYPE_BYTES} B = {kv:,} B.",
        f"Capacity: assumed {options.memory_bytes:,} B for weights + KV cache ({memory_source}) minus "
        f"{weight_bytes:,} B of {_DTYPE_BYTES}-byte weights = {options.memory_bytes - weight_bytes:,} B of KV, "
        f"rounded down to whole {tables.block_size}-token blocks: {capacity:,} tokens.",
        f"The tables cover prompts of {prompts.min():,}-{prompts.max():,} tokens, decode batches of {batches.min()}-{batches.max()} "
        f"and {lengths.min():,}-{lengths.max():,} tokens per sequence; beyond that the formula extrapolates. "
        "A mixed step (prefills and decodes together) is charged the sum of both parts.",
    ]
