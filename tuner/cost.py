"""Per-step time and per-device memory of one model copy laid out over TP x PP devices.

Roofline per layer and device: a matmul takes max(FLOPs / rate, weight bytes / bandwidth);
attention adds its FLOPs (prefill: every query token against its context) and its KV reads
(decode: the whole context of every sequence); tensor parallelism adds two all-reduces of the
step's activations per layer; pipeline parallelism adds one activation send per stage boundary
and, with no micro-batching inside one step, runs the stages one after another. Fixed per-layer
and per-step costs are fitted constants of the hardware profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engines.core.config import ModelConfig
from tuner.profiles import HardwareProfile

WEIGHT_DTYPES = ("bfloat16", "float16", "float32", "fp8")
_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
GIB = 2**30
COMPONENTS = ("matmul", "matmul_mt", "attention", "comm", "layer", "seq_layer", "seq", "step")
"""The parts of a step's time, one per profile coefficient (CostModel.components). matmul_mt is
the matmul time of a CPU shard that runs several threads (its own rate table, the one other
processes on a shared host slow most); matmul is every other matmul."""


CACHE_MISS_RAMP = (1.0, 2.0)
"""A model copy's weights (bytes, as multiples of the last-level cache) at which a step starts to
read them from memory and at which it reads all of them (CostModel.weight_stream_bytes)."""


class LayoutError(ValueError):
    """A TP x PP layout cannot hold the model; the message says why."""


def layout_problem(model: ModelConfig, tp: int, pp: int) -> str | None:
    """Why `model` cannot be split tp-ways and into pp stages, or None."""
    if tp < 1 or pp < 1:
        return f"tp ({tp}) and pp ({pp}) must be >= 1"
    if model.n_head % tp:
        return f"tp: n_head ({model.n_head}) is not divisible by tp ({tp})"
    if model.kv_heads % tp and tp % model.kv_heads:
        return f"tp: n_kv_head ({model.kv_heads}) and tp ({tp}) do not divide one another"
    if model.ffn_dim % tp:
        return f"tp: the MLP width ({model.ffn_dim}) is not divisible by tp ({tp})"
    if model.n_layer < pp:
        return f"pp: {model.n_layer} layers cannot fill {pp} pipeline stages"
    return None


@dataclass(frozen=True)
class StepWork:
    """What one engine step computes (sums over the step's sequences)."""

    tokens: int
    """Tokens through the layers (decode tokens + prefill chunk tokens)."""
    sampled: int
    """Rows through the LM head (sequences that get a token this step)."""
    prefill_attn_pairs: int = 0
    """Sum over prefill tokens of the context each attends to (query x key pairs)."""
    decode_context: int = 0
    """Sum over decode tokens of their context length (KV tokens read)."""
    seqs: int = 0
    """Sequences in the step (a prefill chunk that samples nothing counts); 0 means `sampled`."""


@dataclass(frozen=True)
class CostModel:
    model: ModelConfig
    profile: HardwareProfile
    tp: int = 1
    pp: int = 1
    weight_dtype: str = "bfloat16"
    kv_dtype_bytes: int = 0
    """Bytes per KV element; 0: 4 with float32 weights (the engine's cache dtype), else 2."""

    @property
    def kv_bytes(self) -> int:
        return self.kv_dtype_bytes or (4 if self.weight_dtype == "float32" else 2)

    def __post_init__(self) -> None:
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise LayoutError(f"weight_dtype: must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        problem = layout_problem(self.model, self.tp, self.pp)
        if problem:
            raise LayoutError(problem)
        # step_time by work (not a field: equality and hashing stay the model's). A simulated schedule
        # repeats its steps' work: requests of one length admitted together decode in lock step (792
        # steps of a 129-request validation burst are 48 distinct works), and each simulation of the
        # refit's polish and the goodput search asks the same model again
        object.__setattr__(self, "_step_times", {})

    # shapes ----------------------------------------------------------------------------------
    @property
    def layer_params(self) -> float:
        m = self.model
        return (m.num_params(include_embeddings=False) - m.n_embd * (2 if m.model_type == "gpt2" else 1)
                - (0 if m.tie_word_embeddings else m.vocab_size * m.n_embd)) / m.n_layer

    @property
    def layers_per_stage(self) -> int:
        return math.ceil(self.model.n_layer / self.pp)

    @property
    def kv_heads_per_device(self) -> int:
        return max(1, self.model.kv_heads // self.tp)

    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes of one token on one device (keys and values, its stage's layers)."""
        return 2 * self.layers_per_stage * self.kv_heads_per_device * self.model.hd * self.kv_bytes

    def weight_bytes_per_device(self) -> float:
        """Weights of the fullest device: its stage's layers plus embedding and LM head."""
        m, wb = self.model, _BYTES[self.weight_dtype]
        vocab = m.vocab_size * m.n_embd / self.tp * wb
        emb = vocab + (m.max_position_embeddings * m.n_embd * wb if m.model_type == "gpt2" else 0)
        head = 0 if m.tie_word_embeddings and self.pp == 1 else vocab
        return self.layers_per_stage * self.layer_params / self.tp * wb + emb + head

    # time ------------------------------------------------------------------------------------
    def _link(self) -> float:
        p = self.profile
        bw = p.intra_node_bandwidth_gb_s if self.tp * self.pp <= p.devices_per_node else p.inter_node_bandwidth_gb_s
        return bw * 1e9

    def _allreduce(self, nbytes: float) -> float:
        if self.tp == 1:
            return 0.0
        tp_bw = self.profile.intra_node_bandwidth_gb_s * 1e9 if self.tp <= self.profile.devices_per_node \
            else self.profile.inter_node_bandwidth_gb_s * 1e9
        return self.profile.collective_latency_us * 1e-6 + 2 * (self.tp - 1) / self.tp * nbytes / tp_bw

    def components(self, w: StepWork) -> dict[str, float]:
        """Seconds of one engine step, split by the profile coefficient each part scales with
        (the refit in tuner.refit fits one factor per part); step_time is their sum."""
        if w.tokens <= 0:
            return dict.fromkeys(COMPONENTS, 0.0)
        p, m = self.profile, self.model
        shards = self.tp * self.pp
        layers = self.pp * self.layers_per_stage  # stages run one after another within a step
        seqs = w.seqs or w.sampled
        bw = p.hbm_bandwidth_gb_s * 1e9 * p.bw_efficiency
        act_dtype = "float32" if self.weight_dtype == "float32" else "bfloat16"
        lay = p.layout(self.tp, self.pp)
        if lay is not None and not w.prefill_attn_pairs and isinstance(lay.get("decode"), dict):
            # a decode step of a layout with constants of its own for them: fitted on the engine's
            # decode batches of 1-16 in one process, placed at the served steps' level
            # (tuner.measure_engine.fit_on_engine)
            lay = lay["decode"]
        if lay is not None:  # fitted on this layout's own engine steps (real executor, its threads)
            kv_rate, pre_rate = lay["attention_kv_gb_s"] * 1e9, lay["attention_prefill_tflops"] * 1e12
        else:
            # CPU rates were measured with every core; a shard of a TP x PP layout has cores // shards
            share = p.threads(shards) / p.cores if p.cores else 1.0
            kv_rate = (p.attention_kv_gb_s * 1e9 * share) if p.attention_kv_gb_s else bw
            pre_rate = (p.attention_prefill_tflops * 1e12 * share) if p.attention_prefill_tflops \
                else p.flops(act_dtype) * p.flops_efficiency
        attn = (4 * m.n_head // self.tp * m.hd * w.prefill_attn_pairs / pre_rate
                + 2 * self.kv_heads_per_device * m.hd * self.kv_bytes * w.decode_context / kv_rate)
        const = {k: getattr(p, k) for k in ("layer_overhead_us", "seq_layer_overhead_us", "seq_overhead_us",
                                             "step_overhead_ms")}
        comm = self.comm_time(w)
        if lay is not None:
            # the one-thread table's shape in rows and width, the level this layout's engine reached
            mm = self.matmul_time(w, threads=1) * lay["matmul_scale"]
            if lay.get("matmul_mt_scale") and p.threads(shards) > 1:
                mm += self.matmul_time(w, threads=p.threads(shards)) * lay["matmul_mt_scale"]
            if lay.get("dram_weight_gb_s"):  # weights past the last-level cache, read from memory
                # at the host's read bandwidth now against the profile's (host_scale, tuner.hostref;
                # divided by the cpu scale that every part gets below)
                mm += (self.weight_stream_bytes(w) / (lay["dram_weight_gb_s"] * 1e9)
                       * p.scale("memory") / p.scale("cpu"))
            comm *= lay["comm_scale"]
            const = {k: lay[k] for k in const}
        else:
            mm = self.matmul_time(w)
        multi = bool(p.cores and p.matmul_tflops and p.threads(shards) > 1)
        parts = {
            "matmul": 0.0 if multi else mm,
            "matmul_mt": mm if multi else 0.0,
            "attention": layers * attn,
            "comm": comm,
            "layer": layers * (const["layer_overhead_us"] * 1e-6
                               + (p.prefill_layer_overhead_us * 1e-6 if w.prefill_attn_pairs else 0.0)
                               # a decode step of 2+ rows: the batch kernels' own cost per layer beyond
                               # the batch-1 path's (engines.cpu.fused_decode; tuner.measure_engine.fit_on_engine)
                               + (lay.get("decode_batch_layer_us", 0.0) * 1e-6
                                  if lay and not w.prefill_attn_pairs and seqs >= 2 else 0.0)
                               + (lay.get("token_layer_width_ns", 0.0) * 1e-9 * w.tokens * m.n_embd / self.tp
                                  if lay else 0.0)),
            "seq_layer": layers * seqs * const["seq_layer_overhead_us"] * 1e-6,
            "seq": w.sampled * (const["seq_overhead_us"] * 1e-6
                                + (lay.get("vocab_seq_ns", 0.0) * 1e-9 * m.vocab_size / self.tp if lay else 0.0))
                   # the LM head's per-step work beyond its matmul, by the size of its weight slice
                   + (lay.get("head_ns", 0.0) * 1e-9 * m.vocab_size * m.n_embd / self.tp if lay and w.sampled else 0.0),
            "step": const["step_overhead_ms"] * 1e-3
                    # a step with a prefill chunk: its own fixed work (prefill attention's setup, the module path)
                    + (lay.get("prefill_step_ms", 0.0) * 1e-3 if lay and w.prefill_attn_pairs else 0.0),
        }
        if lay is not None and lay.get("served_decode_scale"):
            # decode constants fitted on the engine's own steps in one process: a served decode
            # step is served_decode_scale times that plus served_step_ms (fit_on_engine)
            parts = {k: v * lay["served_decode_scale"] for k, v in parts.items()}
            parts["step"] += lay.get("served_step_ms", 0.0) * 1e-3
        # a recalibrated profile (tuner.hostref): the host's CPU speed now against the profile's; the
        # weight-streaming share of "matmul" was set to its memory scale above (divided by cpu here)
        cpu = p.scale("cpu")
        return {k: v * cpu for k, v in parts.items()} if cpu != 1.0 else parts

    def matmul_time(self, w: StepWork, threads: int = 0) -> float:
        """Seconds of a step's Linear layers on one shard (its layers and the LM head): per Linear
        max(FLOPs / rate, weight bytes / bandwidth), the rate from the profile's table at the
        shard's threads (or `threads`) and the model's width, else its peak x efficiency."""
        p, m = self.profile, self.model
        bw = p.hbm_bandwidth_gb_s * 1e9 * p.bw_efficiency
        wbytes = _BYTES[self.weight_dtype]
        shards = self.tp * self.pp

        def matmul(params: float, rows: int) -> float:
            """A Linear of `params` weights (this device's shard) over `rows` activation rows."""
            if rows <= 0:
                return 0.0
            rate = p.matmul_rate(self.weight_dtype, rows, shards, width=m.n_embd, threads=threads)
            rate = p.flops(self.weight_dtype) * p.flops_efficiency if rate is None else rate * p.flops_efficiency
            return max(2 * params * rows / rate, params * wbytes / bw)

        layers = self.pp * self.layers_per_stage
        return layers * matmul(self.layer_params / self.tp, w.tokens) + matmul(m.vocab_size * m.n_embd / self.tp, w.sampled)

    def weight_stream_bytes(self, w: StepWork) -> float:
        """Weight bytes one step reads from memory rather than the last-level cache, along the
        step's critical path (every stage's layers, one TP shard's slice, and the LM head when the
        step samples). The matmul rate table is measured on one cache-resident Linear; a model copy
        whose weights (all shards: they share the host's cache) outgrow the cache streams them from
        memory at every step. The share that misses ramps from 0 at the cache's size to 1 at twice
        it (a cyclic read of a buffer past an LRU-like cache misses almost always). 0 without
        profile.cache_mib."""
        p, m = self.profile, self.model
        if not p.cache_mib or w.tokens <= 0:
            return 0.0
        wb = _BYTES[self.weight_dtype]
        head = m.vocab_size * m.n_embd
        copy = (m.n_layer * self.layer_params + head * (1 if m.tie_word_embeddings else 2)) * wb
        lo, hi = (f * p.cache_mib * 2**20 for f in CACHE_MISS_RAMP)
        miss = min(max((copy - lo) / (hi - lo), 0.0), 1.0)
        path = (self.pp * self.layers_per_stage * self.layer_params + (head if w.sampled else 0)) / self.tp * wb
        return miss * path

    def comm_time(self, w: StepWork) -> float:
        """Seconds of a step's TP all-reduces (two per layer and one of the sampled logits) and
        PP activation sends, from the profile's collective and send costs."""
        p, m = self.profile, self.model
        layers = self.pp * self.layers_per_stage
        act = w.tokens * m.n_embd * (4 if self.weight_dtype == "float32" else 2)  # bytes of the step's activations
        head_comm = self._allreduce(w.sampled * m.vocab_size * 4 / self.tp)
        send_lat = (p.send_latency_us or p.collective_latency_us) * 1e-6
        return layers * 2 * self._allreduce(act) + head_comm + (self.pp - 1) * (send_lat + act / self._link())

    def step_time(self, w: StepWork) -> float:
        """Seconds of one engine step."""
        if w.tokens <= 0:
            return 0.0
        t = self._step_times.get(w)
        if t is None:
            t = self._step_times[w] = sum(self.components(w).values())
        return t

    # memory ----------------------------------------------------------------------------------
    def kv_budget_bytes(self, gpu_memory_utilization: float = 0.9) -> float:
        """Device memory left for the KV cache (may be negative: the weights do not fit)."""
        p = self.profile
        return p.memory_gib * GIB * gpu_memory_utilization - p.reserved_memory_gib * GIB - self.weight_bytes_per_device()


def static_batch(cost: CostModel, batch: int, input_len: int, output_len: int) -> dict[str, float]:
    """A batch of `batch` requests arriving together, prefilled in one step, then decoded in
    lock step: how FasterTransformer and NeMo's tool report latency."""
    if min(batch, input_len, output_len) < 1:
        raise ValueError("batch, input_len and output_len must be >= 1")
    pre = cost.step_time(StepWork(tokens=batch * input_len, sampled=batch,
                                  prefill_attn_pairs=batch * input_len * (input_len + 1) // 2))
    dec = sum(cost.step_time(StepWork(tokens=batch, sampled=batch, decode_context=batch * (input_len + k + 1)))
              for k in range(output_len - 1))
    latency = pre + dec
    mem = cost.weight_bytes_per_device() + batch * (input_len + output_len) * cost.kv_bytes_per_token()
    fits = mem + cost.profile.reserved_memory_gib * GIB <= cost.profile.memory_gib * GIB
    return {
        "latency_ms": latency * 1e3,
        "ttft_ms": pre * 1e3,
        "tpot_ms": dec / (output_len - 1) * 1e3 if output_len > 1 else 0.0,
        "throughput_tok_s": batch * output_len / latency,
        "memory_gib_per_device": mem / GIB,
        "fits": bool(fits),
    }
