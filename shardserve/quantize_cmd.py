"""`shardserve quantize` (FP8 checkpoints) and `shardserve eval ppl` (what quantization cost)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer

FORMATS = ("fp8",)
SCALES = ("absmax", "search")
"""--scales: how the data-free default picks each output channel's scale (engines/transforms/fp8_scales.py)."""

eval_app = typer.Typer(help="Evaluate a checkpoint.", no_args_is_help=True)


def _fail(msg: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(code)


ENDS_MIN_BLOCKS = 8
"""--keep-float ends keeps the first and last block float only in a model of at least this many blocks."""


def _kept_blocks(spec: str, n_layer: int) -> list[int]:
    """--keep-float's block indices: 'none', 'ends' or comma-separated integers (range checked by the caller)."""
    spec = spec.strip()
    if spec == "none":
        return []
    if spec == "ends":
        return [0, n_layer - 1] if n_layer >= ENDS_MIN_BLOCKS else []
    try:
        return sorted({int(i) for i in spec.split(",") if i.strip()})
    except ValueError:
        raise _fail(f"--keep-float: expected 'ends', 'none' or comma-separated block indices, got {spec!r}") from None


def quantize(
    model: Path = typer.Option(..., "--model", help="Source checkpoint directory (float weights)."),
    out: Path = typer.Option(..., "--out", help="Directory to write the quantized checkpoint to."),
    format: str = typer.Option("fp8", "--format", help="Quantization format: fp8 (e4m3, per-channel scales)."),
    calibration: Path | None = typer.Option(
        None, "--calibration", help="UTF-8 text file of the model's domain (e.g. a training split) for GPTQ "
        "error compensation; without it (and without --self-calibrate) each weight is rounded to nearest."),
    self_calibrate: bool = typer.Option(
        False, "--self-calibrate", help="GPTQ on text the model writes itself (data-free, seeded by --seed; "
        "minutes). Measured worse than rounding to nearest on SmolLM2-135M (docs/fp8.md): check yours."),
    calibration_windows: int = typer.Option(
        16, help="Calibration windows: spread over the --calibration file, or sequences the model writes."),
    calibration_window: int = typer.Option(256, help="Tokens per calibration window (at most the model's context)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the self-written calibration text (--self-calibrate)."),
    scales: str | None = typer.Option(
        None, "--scales", help="Without calibration: absmax (default: absmax/448, round to nearest) | search "
        "(per output channel, the scale in absmax/448 x [1, 2) whose nearest e4m3 codes give the least squared "
        "error; data-free; measured worse than absmax on SmolLM2-135M, docs/fp8.md). GPTQ (--calibration, "
        "--self-calibrate) keeps absmax scales."),
    keep_float: str | None = typer.Option(
        None, "--keep-float", help="Blocks whose Linears stay in the source dtype (named in "
        "quantization_config.ignore), the rest FP8: comma-separated indices (e.g. 0,2,29), 'ends' (the first "
        "and the last block, in a model of at least 8 blocks; fewer: none) or 'none'. Default: ends when "
        "rounding to nearest (SmolLM2-135M: +0.58 % perplexity against +1.16 % with none, for 4 % more weight "
        "bytes; docs/fp8.md), none with GPTQ (it compensates the error itself)."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace --out when it already holds a checkpoint (its files only: a folder "
        "holding anything else is refused either way)."),
) -> None:
    """Quantize MODEL's block Linear layers and write a checkpoint that vLLM and transformers read.

    fp8: e4m3 weights with one fp32 scale per output channel (absmax / 448), stored in the
    compressed-tensors "float-quantized" layout with dynamic per-token activations (FP8 dynamic);
    embeddings, norms and the LM head keep the source dtype. By default each weight is rounded to nearest
    on its row's absmax / 448; --scales search (data-free) picks each output channel's scale instead
    (engines/transforms/fp8_scales.py: the one of 24 in absmax/448 x [1, 2) whose nearest codes
    reconstruct the row best). GPTQ (engines/transforms/fp8_gptq.py) chooses the e4m3 codes on calibration inputs: --calibration
    TEXT, or --self-calibrate (data-free: --calibration-windows sequences of --calibration-window tokens
    the model writes itself from a random first token, seeded by --seed; engines/transforms/fp8_selfcal.py);
    same scales and file layout, smaller output error on text like the calibration's. With GPTQ the codes
    of the LM head (per-row scales) are written beside, in fp8_head/, for an engine run with
    lm_head_dtype fp8 (transformers and vLLM do not read that folder). Progress bars show both steps.
    The source's generation_config.json and tokenizer files are copied.

    --out must be a new or empty folder, or (with --overwrite) one holding a checkpoint and nothing else;
    it may not be MODEL, contain it, or lie inside it (MODEL would then hold a second model that a later
    replace of MODEL deletes). Nothing else is ever deleted.
    """
    import torch

    from engines.core.config import ConfigError, ModelConfig
    from engines.loading.checkpoint import (
        QUANTIZABLE,
        CheckpointError,
        TensorReader,
        fp8_scheme,
        load_model,
        quantized_params,
        weight_plan,
    )
    from engines.transforms.fp8_format import Fp8FormatError

    if format not in FORMATS:
        raise _fail(f"--format: {format!r} is not supported; supported: {', '.join(FORMATS)}")
    from engines.loading.output_dir import OutputDirError, check_output_dir

    try:
        check_output_dir(out, what="--out", overwrite=overwrite, sources=(model,),
                         overwrite_hint="pass --overwrite")
    except OutputDirError as exc:
        raise _fail(str(exc)) from None
    if model.resolve() in out.resolve().parents:
        raise _fail(f"--out: {str(out)!r} lies inside --model {str(model)!r}; write the quantized model to a folder "
                    "outside the source")
    if self_calibrate and calibration is not None:
        raise _fail("--self-calibrate: the model writes its own calibration text; give --self-calibrate or "
                    "--calibration, not both")
    if scales is not None and (calibration is not None or self_calibrate):
        raise _fail("--scales: applies without calibration; GPTQ (--calibration, --self-calibrate) keeps absmax "
                    "scales")
    scales = scales or "absmax"
    if scales not in SCALES:
        raise _fail(f"--scales: {scales!r} is not supported; supported: {', '.join(SCALES)}")
    if keep_float is None:
        keep_float = "none" if calibration is not None or self_calibrate else "ends"
    if calibration_windows < 1:
        raise _fail(f"--calibration-windows: must be >= 1, got {calibration_windows}")
    if calibration_window < 8:
        raise _fail(f"--calibration-window: must be >= 8 tokens, got {calibration_window}")
    try:
        cfg = ModelConfig.from_dir(model)
        reader = TensorReader(model)
        if quantized_params(cfg, reader, fp8_scheme(model)):
            raise _fail(f"--model: {str(model)!r} is already an FP8 checkpoint")
        src_dtype = reader.get(next(iter(weight_plan(cfg).values()))[0].name).dtype
        if not src_dtype.is_floating_point:
            raise _fail(f"--model: embedding dtype {src_dtype} is not a float type")
        head = None
        kept = _kept_blocks(keep_float, cfg.n_layer)
        bad = [i for i in kept if not 0 <= i < cfg.n_layer]
        if bad:
            raise _fail(f"--keep-float: block indices must be in [0, {cfg.n_layer}), got {bad}")
        keep = frozenset(f"blocks.{i}.{p}" for i in kept for p in ("attn.qkv", "attn.proj", "mlp.up", "mlp.down"))
        if calibration is None and not self_calibrate:  # data-free: absmax (or searched) scales, nearest codes
            net, cfg = load_model(model, dtype=src_dtype)
            if scales == "search" or keep:
                _search(net, keep, scales == "search")
        else:
            wins = (_text_windows(model, calibration, calibration_windows, calibration_window)
                    if calibration is not None else _self_windows(model, calibration_windows, calibration_window, seed))
            # GPTQ's calibration pass and Hessians run in fp32; the file keeps src_dtype either way
            net, cfg = load_model(model, dtype=torch.float32)
            head = _gptq(net, wins, keep)
        before = _linear_bytes(reader, cfg)
        from engines.loading.checkpoint import save_checkpoint

        save_checkpoint(net, cfg, out, dtype=src_dtype, fp8=not keep, tokenizer_dir=model, overwrite=overwrite,
                        generation_config=model / "generation_config.json")
        if head is not None:  # GPTQ codes of the LM head, for lm_head_dtype fp8 (a sub-folder: HF / vLLM skip it)
            from engines.transforms.fp8_format import HEAD_FILE, save_fp8_head

            save_fp8_head(out, *head)
            (out / HEAD_FILE).chmod((out / "config.json").stat().st_mode & 0o666)  # safetensors writes 0600
    except (CheckpointError, ConfigError, Fp8FormatError, FileNotFoundError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    after = _linear_bytes(TensorReader(out), cfg)
    n = sum(len(sources) for name, sources in weight_plan(cfg).items()
            if name.endswith(QUANTIZABLE) and name.removesuffix(".weight") not in keep)
    total_in = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    total_out = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    how = (f"GPTQ on {calibration}" if calibration is not None else
           f"GPTQ on {calibration_windows} x {calibration_window} tokens the model wrote itself (seed {seed})"
           if self_calibrate else "searched scales, round to nearest" if scales == "search" else
           "absmax scales, round to nearest")
    if keep:
        how += f"; blocks {','.join(map(str, kept))} kept float"
    typer.echo(f"quantized {n} Linear layers to FP8 e4m3 (per-channel fp32 scales, {how}), the rest kept in "
               f"{str(src_dtype).removeprefix('torch.')} -> {out}")
    typer.echo(f"quantized layers: {before:,} -> {after:,} bytes ({after / max(before, 1):.3f}x); "
               f"weight files: {total_in:,} -> {total_out:,} bytes ({total_out / max(total_in, 1):.3f}x)")
    if cfg.model_type == "gpt2":
        typer.echo("note: model_type gpt2: shardserve and vLLM read this file; transformers does not run it "
                   "correctly (its GPT-2 layers are Conv1D, which compressed-tensors does not quantize, so it "
                   "loads the e4m3 values without their scales). Llama-family files load in all three. "
                   "See docs/fp8.md.")


def _search(net, keep: frozenset[str], search: bool) -> None:
    """Quantize net's block Linears not in `keep` in place: searched per-channel scales
    (fp8_scales.search_quantize) or, search False, absmax ones (round to nearest)."""
    import torch

    from engines.transforms.fp8 import BLOCK_LINEARS
    from engines.transforms.fp8_scales import search_quantize

    n = sum(1 for name, m in net.named_modules() if name.endswith(BLOCK_LINEARS) and isinstance(m, torch.nn.Linear)
            and name not in keep)
    with _progress(n, "scale search" if search else "quantize", "layer") as bar:
        search_quantize(net, keep, on_layer=lambda _name: bar.update(1), coarse=16 if search else 1)


def _gptq(net, wins, keep: frozenset[str] = frozenset()):
    """Quantize net's block Linears in place with GPTQ on `wins` (n, T) token ids and return GPTQ codes and
    scales of its LM head (for lm_head_dtype fp8: the file keeps the head in the source dtype)."""
    import torch

    from engines.transforms.fp8 import BLOCK_LINEARS
    from engines.transforms.fp8_gptq import gptq_head, gptq_quantize

    n = sum(1 for name, m in net.named_modules() if name.endswith(BLOCK_LINEARS) and isinstance(m, torch.nn.Linear))
    with _progress(n + 1, "GPTQ", "layer") as bar:  # the block Linears, then the LM head
        gptq_quantize(net, wins, keep, on_layer=lambda _name: bar.update(1))
        head = gptq_head(net, wins)
        bar.update(1)
    return head


def _text_windows(model: Path, calibration: Path, windows: int, window: int):
    """(n, T) token ids spread over the calibration text, tokenized with the model's tokenizer; raises
    ValueError naming --calibration for an unusable file."""
    from engines.loading.tokenizer import Tokenizer
    from engines.transforms.fp8_gptq import calibration_windows

    if not calibration.is_file():
        raise ValueError(f"--calibration: {str(calibration)!r} is not a file")
    tk = Tokenizer.from_dir(model)
    if tk is None:
        raise ValueError(f"--calibration: {str(model)!r} has no tokenizer.json to tokenize the text with")
    try:
        text = calibration.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--calibration: {str(calibration)!r} is not UTF-8 text ({exc})") from exc
    try:
        return calibration_windows(tk.encode(text), windows, window)
    except ValueError as exc:
        raise ValueError(f"--calibration: {exc}") from exc


def _self_windows(model: Path, windows: int, window: int, seed: int):
    """(n, T) token ids the model writes itself (data-free calibration, engines/transforms/fp8_selfcal.py)."""
    from engines.transforms.fp8_selfcal import self_generated_windows

    typer.echo(f"calibration: {windows} sequences of {window} tokens written by the model itself (seed {seed}); "
               "(--self-calibrate)", err=True)
    with _progress(windows * window, "calibration text", "tok") as bar:
        wins = self_generated_windows(model, windows, window, seed=seed, on_tokens=bar.update)
        bar.total = bar.n  # a window longer than the model's context was cut to it
        bar.refresh()
    return wins


def _progress(total: int, desc: str, unit: str):
    """A tqdm bar (on stderr) that leaves no monitor thread behind when it closes."""
    from tqdm import tqdm

    class _Bar(tqdm):
        monitor_interval = 0

    return _Bar(total=total, desc=desc, unit=unit)


def _linear_bytes(reader, cfg) -> int:
    """Bytes of the block Linear weights (and their scales, when present) in a checkpoint."""
    from engines.loading.checkpoint import QUANTIZABLE, scale_name, weight_plan

    total = 0
    for ours, sources in weight_plan(cfg).items():
        if not ours.endswith(QUANTIZABLE):
            continue
        for src in sources:
            for name in (src.name, scale_name(src.name)):
                if reader.has(name):
                    t = reader.get(name)
                    total += t.numel() * t.element_size()
    return total


def _token_file(tokens: Path | None) -> tuple[Path, str]:
    """The token file and its dtype (meta.json beside it, as training's data folder writes)."""
    path = tokens or Path("data/shakespeare/val.bin")
    if not path.is_file():
        hint = " (prepare the default corpus with `shardserve data`)" if tokens is None else ""
        raise _fail(f"--tokens: {str(path)!r} is not a file{hint}")
    meta = path.parent / "meta.json"
    dtype = "uint16"
    if meta.is_file():
        try:
            dtype = json.loads(meta.read_text()).get("dtype", dtype)
        except json.JSONDecodeError as exc:
            raise _fail(f"{meta}: not valid JSON ({exc})") from exc
    return path, dtype


def perplexity(model_dir: Path, tokens: Path | None = None, window: int = 0, max_tokens: int = 0,
               weight_dtype: str = "auto", dtype: str = "float32", batch: int = 8) -> dict:
    """Validation perplexity of a checkpoint over a token file, through the engine's model and
    its FP8 transformation (the same layers `shardserve serve` runs).

    The file is cut into non-overlapping windows of `window` tokens (default: the model's
    context); every token but each window's first is predicted from the ones before it in its
    window. Returns {"ppl", "nll", "tokens", ...}.
    """
    import numpy as np
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from engines.loading.checkpoint import load_model
    from engines.transforms.fp8 import apply_fp8

    path, tdtype = _token_file(tokens)
    data = np.memmap(path, dtype=np.dtype(tdtype), mode="r")
    if max_tokens < 0:
        raise ValueError(f"max_tokens: must be >= 0 (0 = the whole file), got {max_tokens}")
    if max_tokens:
        data = data[:max_tokens]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model, cfg = load_model(model_dir, dtype=torch_dtype)
    report = apply_fp8(model, weight_dtype, "cpu", torch_dtype)
    w = window or cfg.max_position_embeddings
    if not 2 <= w <= cfg.max_position_embeddings:
        raise ValueError(f"window: must be in [2, {cfg.max_position_embeddings}] (the model's context), got {w}")
    n_win = len(data) // w
    if n_win == 0:
        raise ValueError(f"tokens: {path} holds {len(data)} tokens, fewer than one window of {w}")
    if int(data[:n_win * w].max()) >= cfg.vocab_size:
        raise ValueError(f"tokens: {path} holds ids >= the model's vocab_size {cfg.vocab_size} "
                         f"(dtype {tdtype} from meta.json); wrong file or model")
    nll, count = 0.0, 0
    with torch.inference_mode():
        for i in tqdm(range(0, n_win, batch), desc="eval ppl", unit="batch", leave=False):
            k = min(batch, n_win - i)
            x = torch.from_numpy(np.asarray(data[i * w:(i + k) * w], dtype=np.int64)).view(k, w)  # (B, T)
            logits = model.logits(model(x[:, :-1]))  # (B, T-1, V) fp32
            nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                   reduction="sum").item()
            count += k * (w - 1)
    return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count, "windows": n_win, "window": w,
            "weight_dtype": "fp8" if report.fp8 else dtype, "fp8_backend": report.backend if report.fp8 else None,
            "model": str(model_dir), "token_file": str(path)}


@eval_app.command("ppl")
def ppl(
    model: Path = typer.Option(..., "--model", help="Checkpoint directory."),
    tokens: Path | None = typer.Option(None, "--tokens", help="Token file (raw uint16/uint32, dtype from a "
                                       "meta.json beside it); default data/shakespeare/val.bin."),
    window: int = typer.Option(0, help="Tokens per window; 0 uses the model's context length."),
    max_tokens: int = typer.Option(0, help="Evaluate only the first N tokens of the file; 0 = all."),
    weight_dtype: str = typer.Option("auto", help="auto (what the checkpoint holds) | fp8 (quantize at load)."),
    dtype: str = typer.Option("float32", help="Compute dtype: float32 | bfloat16 | float16."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a line."),
) -> None:
    """Validation perplexity of MODEL on a token file, so a user sees what quantization cost."""
    from engines.core.config import WEIGHT_DTYPES, ConfigError
    from engines.loading.checkpoint import CheckpointError

    if weight_dtype not in WEIGHT_DTYPES:
        raise _fail(f"--weight-dtype: must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise _fail(f"--dtype: must be float32, bfloat16 or float16, got {dtype!r}")
    if max_tokens < 0:
        raise _fail(f"--max-tokens: must be >= 1, or 0 for the whole file, got {max_tokens}")
    try:
        r = perplexity(model, tokens, window, max_tokens, weight_dtype, dtype)
    except (CheckpointError, ConfigError, FileNotFoundError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    if as_json:
        typer.echo(json.dumps(r))
    else:
        typer.echo(f"ppl {r['ppl']:.4f}  (nll {r['nll']:.5f} nats/token over {r['tokens']:,} tokens, "
                   f"{r['windows']} windows of {r['window']}; weights {r['weight_dtype']})")
