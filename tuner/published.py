"""Published GPT inference latencies and the fit of the A100 profile's constants to them.

Source: NVIDIA/FasterTransformer docs/gpt_guide.md, "Performance" (8x A100-80GB SXM per node,
NVSwitch; FP16; latency of a static batch from the request to the last output token, in ms).
Fitted on: GPT-20B, input 20 / output 8, every batch and TP 1/2/4/8 (36 points), and the one-GPU
input 128 / output 8 rows of GPT-6.7B, GPT-1.3B and GPT-350M (21 points): models of 24, 32 and 44
layers, so that a step's fixed cost splits into a per-layer and a per-step part (from GPT-20B alone
the two are the same column: every point has 44 layers). The GPT-175B and GPT-89B tables are the
guide's "inference time of Megatron and FasterTransformer on Triton": a request through Triton
Inference Server, whose cost per request (the client call, the server, the backend's hand-off to
its eight ranks: the guide does not split it) the engine-only tables do not have. That cost is fitted on the GPT-89B rows (TP 8, 128 / 8
and 512 / 32, every batch: triton_request_ms) and added to every Triton row. Held out: every other
row (GPT-20B 60/20, 128/20, 80/200; the 512 / 32 rows of the small models; GPT-175B at TP 8),
compared by `python -m tuner.published`.
"""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass

import numpy as np

from engines.core.config import ModelConfig
from tuner.cost import CostModel, static_batch
from tuner.profiles import PROFILE_DIR, HardwareProfile, load_profile


def gpt(n_head: int, n_layer: int, head_size: int = 128) -> ModelConfig:
    """A GPT-3-shaped model as FasterTransformer benchmarks it (vocab 51200)."""
    return ModelConfig(model_type="gpt2", vocab_size=51200, n_layer=n_layer, n_head=n_head,
                       n_embd=n_head * head_size, max_position_embeddings=2048)


MODELS = {"gpt-20b": gpt(48, 44), "gpt-89b": gpt(96, 48), "gpt-175b": gpt(96, 96), "gpt-6.7b": gpt(32, 32),
          "gpt-1.3b": gpt(32, 24, 64), "gpt-350m": gpt(16, 24, 64)}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Point:
    model: str
    tp: int
    batch: int
    input_len: int
    output_len: int
    latency_ms: float
    fitted: bool
    via_triton: bool = False
    """Measured through Triton Inference Server (the guide's large-model tables): the latency has a
    request's way through the server beside the engine's steps (triton_request_ms)."""


def _table(model: str, inp: int, out: int, cols: dict[int, list[float | None]], fitted: bool = False,
           batches: tuple[int, ...] = BATCHES, via_triton: bool = False) -> list[Point]:
    pts = []
    for tp, col in cols.items():
        for b, v in zip(batches, col, strict=False):
            if v is not None:  # None: OOM in the table
                pts.append(Point(model, tp, b, inp, out, float(v), fitted, via_triton))
    return pts


# GPT-20B (head_num 48, size_per_head 128, 44 layers): columns TP 1, 2, 4, 8.
POINTS: list[Point] = [
    *_table("gpt-20b", 20, 8, {
        1: [225, 225, 228, 239, 268, 331, 452, 726, 1352],
        2: [147, 152, 158, 169, 191, 230, 314, 484, 844],
        4: [102, 108, 113, 121, 133, 155, 200, 318, 533],
        8: [89, 94, 100, 107, 113, 127, 169, 256, 416]}, fitted=True),
    *_table("gpt-20b", 60, 20, {
        1: [560, 562, 582, 635, 748, 933, 1352, 2218, 4141],
        2: [358, 378, 393, 429, 510, 620, 887, 1384, 2424],
        4: [248, 262, 274, 299, 345, 418, 574, 928, 1574],
        8: [212, 222, 236, 247, 272, 325, 454, 699, 1152]}),
    *_table("gpt-20b", 128, 20, {
        1: [566, 580, 629, 740, 931, 1335, 2157, 3830, None],
        2: [362, 385, 421, 487, 618, 862, 1379, 2365, 4414],
        4: [254, 267, 290, 333, 405, 547, 832, 1439, 2639],
        8: [217, 227, 244, 267, 312, 418, 634, 1072, 1943]}),
    *_table("gpt-20b", 80, 200, {
        1: [5609, 5588, 5661, 5838, 6167, 6864, 8290, None, None],
        2: [3532, 3682, 3797, 3984, 4356, 4817, 6003, 7884, 12007],
        4: [2438, 2544, 2646, 2741, 2964, 3233, 3815, 5239, 7603],
        8: [2053, 2095, 2206, 2268, 2307, 2566, 3173, 4303, 6087]}),
    # GPT-175B (96 heads, 96 layers) and GPT-89B (96 heads, 48 layers) at TP 8, FT latency.
    # Measured on Triton; the GPT-89B rows fit triton_request_ms (only that), GPT-175B is held out.
    *_table("gpt-175b", 128, 8, {8: [488.86, 509.47, 629.64, 749.86, 1037.47, 1547.44]},
            batches=(1, 2, 4, 8, 16, 32), via_triton=True),
    *_table("gpt-175b", 512, 32, {8: [1719.96, 1830.56, 2092.56, 2629.97, 3706.23]}, batches=(1, 2, 4, 8, 16),
            via_triton=True),
    *_table("gpt-89b", 128, 8, {8: [279.44, 280.24, 317.71, 377.50, 524.80, 786.57]},
            batches=(1, 2, 4, 8, 16, 32), fitted=True, via_triton=True),
    *_table("gpt-89b", 512, 32, {8: [887.52, 940.11, 1133.22, 1415.02, 1952.2]}, batches=(1, 2, 4, 8, 16),
            fitted=True, via_triton=True),
    # GPT-6.7B (32 x 128, 32 layers), GPT-1.3B (32 x 64, 24 layers), GPT-350M (16 x 64, 24 layers), one GPU.
    *_table("gpt-6.7b", 128, 8, {1: [98.29, 106.74, 123.47, 162.51, 241.16, 400.35, 718.07]}, fitted=True),
    *_table("gpt-6.7b", 512, 32, {1: [384.70, 425.88, 514.93, 699.62, 1068.88, 1814.03, 3306.41]}),
    *_table("gpt-1.3b", 128, 8, {1: [36.76, 39.16, 43.32, 52.92, 74.44, 116.74, 201.71]}, fitted=True),
    *_table("gpt-1.3b", 512, 32, {1: [135.85, 150.57, 178.25, 232.11, 345.96, 578.52, 1036.21]}),
    *_table("gpt-350m", 128, 8, {1: [25.43, 26.42, 28.00, 32.56, 42.87, 62.61, 104.51]}, fitted=True),
    *_table("gpt-350m", 512, 32, {1: [92.01, 97.87, 110.70, 136.45, 189.91, 296.15, 529.18]}),
]


def predict(profile: HardwareProfile, p: Point, triton_request_ms: float = 0.0) -> float:
    """The static batch's latency (ms), plus `triton_request_ms` for a point measured through Triton."""
    cost = CostModel(MODELS[p.model], profile, tp=p.tp, pp=1, weight_dtype="float16")
    return static_batch(cost, p.batch, p.input_len, p.output_len)["latency_ms"] + (
        triton_request_ms if p.via_triton else 0.0)


def device_points() -> list[Point]:
    """The points the device constants are fitted on (fit): engine-only tables."""
    return [p for p in POINTS if p.fitted and not p.via_triton]


def fit_triton_request_ms(profile: HardwareProfile, points: list[Point] | None = None) -> float:
    """Triton's cost per request (ms, >= 0): the constant that, added to the profile's static-batch
    latency, gives the least squared relative error on `points` (default: the fitted Triton rows,
    GPT-89B); closed form, sum((m - b) / m^2) / sum(1 / m^2)."""
    pts = [p for p in POINTS if p.fitted and p.via_triton] if points is None else points
    meas = np.array([p.latency_ms for p in pts])
    base = np.array([predict(profile, p) for p in pts])
    return max(float(np.sum((meas - base) / meas**2) / np.sum(1 / meas**2)), 0.0)


FIXED_COSTS = ("layer_overhead_us", "step_overhead_ms", "collective_latency_us")


def fit(profile: HardwareProfile, points: list, predict_fn=None, consts: tuple[str, ...] = FIXED_COSTS
        ) -> HardwareProfile:
    """Grid over the two efficiency factors; for each, the fixed costs `consts` (which enter the
    latency linearly) by non-negative least squares on the relative error. `points` have a
    latency_ms; predict_fn(profile, point) -> ms (default: the published GPT points' static batch)."""
    predict_fn = predict_fn or predict
    meas = np.array([p.latency_ms for p in points])
    zero = {c: 0.0 for c in consts}
    best = None
    for be, fe in itertools.product(np.round(np.arange(0.40, 1.0001, 0.02), 3), np.round(np.arange(0.30, 1.0001, 0.02), 3)):
        base_prof = profile.replace(bw_efficiency=float(be), flops_efficiency=float(fe), **zero)
        base = np.array([predict_fn(base_prof, p) for p in points])
        cols = [np.array([predict_fn(base_prof.replace(**{c: 1.0}), p) for p in points]) - base for c in consts]
        a = np.stack(cols, axis=1) / meas[:, None]
        r = 1.0 - base / meas
        x = np.clip(np.linalg.lstsq(a, r, rcond=None)[0], 0, None)
        err = float(np.sqrt(np.mean((a @ x - r) ** 2)))
        if best is None or err < best[0]:
            best = (err, float(be), float(fe), x)
    _, be, fe, x = best
    return profile.replace(bw_efficiency=round(be, 3), flops_efficiency=round(fe, 3),
                           **{c: round(float(v), 3) for c, v in zip(consts, x, strict=True)})


def compare(profile: HardwareProfile) -> list[dict]:
    """Every published point against the profile (Triton rows with fit_triton_request_ms added)."""
    triton_ms = fit_triton_request_ms(profile)
    rows = []
    for p in POINTS:
        pred = predict(profile, p, triton_ms)
        rows.append({"model": p.model, "tp": p.tp, "batch": p.batch, "input": p.input_len, "output": p.output_len,
                     "published_ms": p.latency_ms, "predicted_ms": round(pred, 1),
                     "error": round(pred / p.latency_ms - 1, 3), "fitted": p.fitted,
                     **({"triton_request_ms": round(triton_ms, 1)} if p.via_triton else {})})
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for name, sel in (("fitted", [r for r in rows if r["fitted"]]), ("held_out", [r for r in rows if not r["fitted"]])):
        errs = np.abs([r["error"] for r in sel])
        out[name] = {"points": len(sel), "median_abs_error": round(float(np.median(errs)), 3),
                     "max_abs_error": round(float(errs.max()), 3), "within_25pct": int((errs <= 0.25).sum())}
    return out


def main(argv: list[str]) -> None:
    """`python -m tuner.published [--fit]`: compare the A100 profile with the published table;
    --fit refits its constants on the fitted rows and rewrites tuner/profiles/a100-80gb.yaml."""
    prof = load_profile("a100-80gb")
    if "--fit" in argv:
        prof = fit(prof, device_points()).replace(
            fit_notes="fitted on FasterTransformer docs/gpt_guide.md GPT-20B 20 in / 8 out, TP 1-8, batch 1-256")
        path = PROFILE_DIR / "a100-80gb.yaml"
        header = "".join(line + "\n" for line in path.read_text().splitlines() if line.startswith("#"))
        path.write_text(header + __import__("yaml").safe_dump(prof.to_dict(), sort_keys=False))
    rows = compare(prof)
    for r in rows:
        print(json.dumps(r))
    print(json.dumps(summary(rows)))


if __name__ == "__main__":
    main(sys.argv[1:])
