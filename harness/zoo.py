"""The model zoo: tiny random-weight checkpoints of many architectures, made here from
transformers configs (nothing is downloaded), each with a "last-layers" fine-tune.  Not shipped.

Every entry of `ZOO` is an `Arch`: a transformers config (``model_type`` and its keys), the
transformers ``Auto*`` class that builds it, and what vLLM's CPU backend makes of it.  The sizes
are chosen so that:

- the CPU attention backend runs them: head size 64 (it supports 32, 64, 80, ...);
- tensors are big enough to be shared (the loader's default ``min_tensor_bytes`` is 64 KiB:
  hidden size 256, MLP width 512 or more, the vocabulary embedding 49152 x 256);
- they stay small: 4 layers, 15 to 60 MB each in bfloat16;
- the tokenizer is SmolLM2's (`sample_models.random_model`), so ``vocab_size`` is its 49152 and
  the special token ids are its own.

`checkpoint` builds (once, cached) the base checkpoint of an architecture; `last_layers` a
fine-tune of it whose last two layers' tensors are perturbed (seeded noise of 1% of each
tensor's standard deviation, as `variants.py` does for SmolLM2): every other tensor is
bit-identical to the base's, so a dedup engine of the fine-tune can map everything else from a
resident base engine (the ``modules`` path).

The references of the final-tensor oracle (`oracle.py`) are `references.py`'s: what "a plain
load with the same options" is lives there.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import xxhash

from .engines import dedup_log_lines
from .references import reference_options
from .sample_models import build_lock, models_dir, random_model
from .variants import load_state_dict, perturbed, save_state_dict, staging_copy

__all__ = ["ARCH_NAMES", "CI_SUBSET", "MODULES_DECLINES", "SECOND_DECLINES", "ZOO", "Arch", "checkpoint", "last_layers", "layer_indices"]

VOCAB = 49152  # SmolLM2's tokenizer
# SmolLM2's special tokens: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2.
_TOKENS = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# The usual shape of a decoder: 4 layers, hidden 256, 4 heads of 64.
_DECODER = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512,
            "max_position_embeddings": 512, **_TOKENS}


@dataclass(frozen=True)
class Arch:
    """One architecture of the zoo.

    Attributes:
        name: the zoo's name for it.
        config: ``model_type`` and the transformers config's other keys.
        auto_class: the transformers class that builds and saves it.
        kind: ``generate`` (a causal LM: compared on greedy tokens) or ``embed`` (a pooling
            model: compared on its embeddings).
        notes: what it exercises (tied or untied head, MoE, SSM, attention sinks, ...).
        dtype: the checkpoint's (and the engines') dtype.
        embeddings_tune: also run `embeddings_tune`'s fine-tune (where a tensor of another
            module is derived from the embedding, or the head is tied to it).
    """

    name: str
    config: dict
    auto_class: str = "AutoModelForCausalLM"
    kind: str = "generate"
    notes: str = ""
    dtype: str = "bfloat16"
    embeddings_tune: bool = False

    @property
    def seed(self) -> int:
        """Each architecture its own weights (equal shapes would otherwise get equal bytes)."""
        return xxhash.xxh32_intdigest(self.name.encode())


def _arch(name: str, model_type: str, notes: str, **config) -> Arch:
    auto_class = config.pop("auto_class", "AutoModelForCausalLM")
    kind = config.pop("kind", "generate")
    embeddings = config.pop("embeddings_tune", False)
    return Arch(name, {"model_type": model_type, **config}, auto_class, kind, notes, embeddings_tune=embeddings)


_ARCHS = [
    # dense decoders ---------------------------------------------------------------------------
    _arch("llama", "llama", "untied head, GQA", **_DECODER, num_key_value_heads=2, tie_word_embeddings=False),
    _arch("qwen2", "qwen2", "tied head, qkv bias", embeddings_tune=True, **_DECODER, num_key_value_heads=2, tie_word_embeddings=True),
    _arch("qwen3", "qwen3", "untied head, q/k norms", **_DECODER, num_key_value_heads=2, head_dim=64,
          tie_word_embeddings=False),
    _arch("mistral", "mistral", "untied head", **_DECODER, num_key_value_heads=2, head_dim=64, sliding_window=None,
          tie_word_embeddings=False),
    _arch("gemma2", "gemma2", "tied head, soft-capping, sliding window every other layer", **_DECODER,
          num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, sliding_window=64,
          tie_word_embeddings=True),
    _arch("gemma3", "gemma3_text", "Gemma3ForCausalLM (text), tied head, q/k norms, local/global layers",
          **_DECODER, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, sliding_window=64,
          tie_word_embeddings=True),
    _arch("phi3", "phi3", "fused qkv and gate_up in the checkpoint, untied head", **_DECODER,
          num_key_value_heads=4, tie_word_embeddings=False),
    _arch("gpt2", "gpt2", "Conv1D weights (transposed on load), tied head, learned positions", embeddings_tune=True,
          n_embd=256, n_layer=4, n_head=4, n_positions=512, **_TOKENS),
    _arch("gpt_neox", "gpt_neox", "vLLM's Transformers backend, partial rotary, untied head", **_DECODER,
          rotary_pct=0.25, tie_word_embeddings=False),
    _arch("opt", "opt", "tied head, learned positions with an offset", hidden_size=256, num_hidden_layers=4,
          num_attention_heads=4, ffn_dim=512, word_embed_proj_dim=256, max_position_embeddings=512, **_TOKENS),
    _arch("falcon", "falcon", "multi-query, parallel attention, tied head", hidden_size=256, num_hidden_layers=4,
          num_attention_heads=4, multi_query=True, parallel_attn=True, new_decoder_architecture=False,
          alibi=False, bias=False, **_TOKENS),
    _arch("stablelm", "stablelm", "partial rotary, untied head", **_DECODER, num_key_value_heads=4,
          partial_rotary_factor=0.25, tie_word_embeddings=False),
    _arch("starcoder2", "starcoder2", "vLLM's Transformers backend, tied head, biases", **_DECODER,
          num_key_value_heads=2, sliding_window=None, tie_word_embeddings=True),
    _arch("olmo2", "olmo2", "vLLM's Transformers backend, q/k norms, untied head", **_DECODER,
          num_key_value_heads=4, tie_word_embeddings=False),
    # mixtures of experts ----------------------------------------------------------------------
    _arch("mixtral", "mixtral", "MoE: 4 experts, top 2 (fused experts)", **{**_DECODER, "intermediate_size": 256},
          num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
          tie_word_embeddings=False),
    _arch("qwen2_moe", "qwen2_moe", "MoE with a shared expert and its gate", **_DECODER, num_key_value_heads=2,
          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=512,
          decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
    # multi-head latent attention (MLA; vLLM's CPU kernel takes kv_lora_rank 512 + rope 64 only):
    # post-processing derives W_UV and W_UK_T from kv_b_proj
    _arch("deepseek_v2", "deepseek_v2", "MLA with kv_b_proj, no q LoRA, dense MLP", **_DECODER, num_key_value_heads=4,
          kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
          first_k_dense_replace=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
          moe_intermediate_size=128, topk_method="greedy", tie_word_embeddings=False),
    _arch("deepseek_v2_lora", "deepseek_v2", "MLA with q LoRA (q_a_proj, q_b_proj), dense MLP",
          **_DECODER, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=96, qk_nope_head_dim=32,
          qk_rope_head_dim=64, v_head_dim=32, first_k_dense_replace=4, n_routed_experts=4, n_shared_experts=1,
          num_experts_per_tok=2, moe_intermediate_size=128, topk_method="greedy", tie_word_embeddings=False),
    _arch("deepseek_v3", "deepseek_v3", "DeepSeek-V3 shape: MLA, MoE with shared experts, e_score_correction_bias",
          **_DECODER, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=96, qk_nope_head_dim=32,
          qk_rope_head_dim=64, v_head_dim=32, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
          num_experts_per_tok=2, moe_intermediate_size=128, n_group=2, topk_group=1, topk_method="noaux_tc",
          scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, tie_word_embeddings=False),
    _arch("glm4_moe", "glm4_moe", "a float32 router gate in a bfloat16 model (vLLM packs float32 linears on AVX2, "
          "not bfloat16 ones), shared experts, e_score_correction_bias", **_DECODER, num_key_value_heads=2,
          head_dim=64, partial_rotary_factor=0.5, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
          num_experts_per_tok=2, moe_intermediate_size=128, n_group=2, topk_group=1, norm_topk_prob=True,
          routed_scaling_factor=2.5, num_nextn_predict_layers=0, tie_word_embeddings=False),
    # others ------------------------------------------------------------------------------------
    _arch("bert_mlm", "bert", "BertForMaskedLM: the MLM decoder is the word embedding (derived tensor)", embeddings_tune=True,
          auto_class="AutoModelForMaskedLM", kind="embed", hidden_size=256, num_hidden_layers=4,
          num_attention_heads=4, intermediate_size=1024, max_position_embeddings=512, **_TOKENS),
    _arch("bert", "bert", "BertModel (embedding, encoder-only attention)", embeddings_tune=True, auto_class="AutoModel", kind="embed",
          hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
          max_position_embeddings=512, **_TOKENS),
    _arch("mamba", "mamba", "SSM (Mamba 1), tied head, A_log -> A on load", hidden_size=256, num_hidden_layers=4,
          state_size=16, expand=2, tie_word_embeddings=True, **_TOKENS),
    _arch("mamba2", "mamba2", "SSM (Mamba 2): conv1d weight viewed by the mixer", hidden_size=256,
          num_hidden_layers=4, num_heads=8, head_dim=64, expand=2, n_groups=1, state_size=64, chunk_size=64,
          tie_word_embeddings=False, **_TOKENS),
    _arch("gpt_oss", "gpt_oss", "attention sinks, MoE experts filled with copy_, sliding window", **_DECODER,
          num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
          tie_word_embeddings=False),
    _arch("jamba", "jamba", "hybrid: Mamba + attention + MoE", **_DECODER, num_key_value_heads=2,
          num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
          attn_layer_period=2, attn_layer_offset=1, mamba_d_state=16, mamba_expand=2, mamba_dt_rank=16,
          use_mamba_kernels=False, tie_word_embeddings=False),
    _arch("gemma4", "gemma4_text", "per-layer embeddings (Gemma4ForCausalLM)", embeddings_tune=True, **_DECODER,
          num_key_value_heads=2, head_dim=64, global_head_dim=64, sliding_window=64, hidden_size_per_layer_input=64,
          vocab_size_per_layer_input=VOCAB, tie_word_embeddings=True),
]

ZOO: dict[str, Arch] = {a.name: a for a in _ARCHS}
ARCH_NAMES = tuple(ZOO)
# The end-to-end test's subset: a tied head (qwen2); an untied head, MoE experts and attention
# sinks filled with copy_ (gpt_oss); BERT, whose MLM decoder is derived from the embedding; an SSM
# whose mixer views another module's parameter (mamba2); MLA, whose W_UV and W_UK_T are views of
# kv_b_proj's weight, with MoE and shared experts (deepseek_v3).
CI_SUBSET = ("qwen2", "gpt_oss", "bert_mlm", "mamba2", "deepseek_v3")
# Where a second engine of an unchanged checkpoint still does not take the whole fast path, and
# why (docs/zoo.md); anywhere else that is a failure.
# (mamba2 was one until its causal-conv weight, packed by vLLM's CPU path, was recorded as the weight
# it was before: `engine.recipe_builder.conv_weight_recipe`.)
SECOND_DECLINES: dict[str, str] = {}
# Where a fine-tune (last layers, embeddings) of a served architecture still does not map its
# unchanged modules, and why; anywhere else that is a failure.  (falcon, gpt_oss, bert and
# bert_mlm were until their loaders' transformed tensors, writes by hand and the MLM decoder's copy
# were traced: `engine.provenance`.)
MODULES_DECLINES: dict[str, str] = {}

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h)\.(\d+)\.")
_TOKEN_EMBEDDING = re.compile(r"(embed_tokens|word_embeddings|wte|embeddings)(_per_layer)?\.weight$")


def checkpoint(name: str, root: Path | None = None) -> Path:
    """The base checkpoint of architecture ``name`` (an HF safetensors folder), built once and
    cached under ``root`` (default ``<models_dir>/zoo``).

    Raises:
        KeyError: ``name`` is not in `ZOO`.
    """
    arch = ZOO[name]
    return random_model(f"zoo-{name}", arch.config, dtype=arch.dtype, auto_class=arch.auto_class, seed=arch.seed,
                        root=Path(root or models_dir() / "zoo"))


def layer_indices(names) -> list[int]:
    """The decoder (or encoder) layer indices that checkpoint tensor ``names`` mention."""
    return sorted({int(m.group(1)) for n in names if (m := _LAYER.search(n))})


def last_layers(base: Path, layers: int = 2, seed: int = 0) -> Path:
    """A fine-tune of ``base`` whose last ``layers`` layers' floating-point tensors are perturbed
    (seeded noise, 1% of each tensor's standard deviation); everything else bit-identical.
    Built once beside ``base`` (``<base>-last-layers``).

    Raises:
        ValueError: ``base``'s tensor names mention no layer index.
    """
    import torch

    def tune(tensors: dict) -> dict:
        indices = layer_indices(tensors)
        if not indices:
            raise ValueError(f"{base}: no layer index in its tensor names")
        changed = set(indices[-layers:])
        gen = torch.Generator().manual_seed(seed)
        for name, t in tensors.items():
            m = _LAYER.search(name)
            if m and int(m.group(1)) in changed and t.is_floating_point() and t.numel() > 1:
                tensors[name] = perturbed(t, gen)
        return tensors

    return _built_beside(Path(base), "last-layers", tune)


def embeddings_tune(base: Path, seed: int = 0) -> Path:
    """A fine-tune of ``base`` whose token embedding tensors (names holding ``embed`` or
    ``wte``, not position embeddings) are perturbed as in `last_layers`; everything else
    bit-identical.  Where the head is tied to the embedding, or another module's tensor is
    derived from it (BertForMaskedLM's MLM decoder), that tensor must follow.  Built once beside
    ``base`` (``<base>-embeddings``).

    Raises:
        ValueError: no tensor of ``base`` is a token embedding.
    """
    import torch

    def tune(tensors: dict) -> dict:
        names = [n for n in tensors if _TOKEN_EMBEDDING.search(n) and "position" not in n and "token_type" not in n]
        if not names:
            raise ValueError(f"{base}: no token embedding among its tensors")
        gen = torch.Generator().manual_seed(seed)
        for name in names:
            tensors[name] = perturbed(tensors[name], gen)
        return tensors

    return _built_beside(Path(base), "embeddings", tune)


def _built_beside(base: Path, suffix: str, tune) -> Path:
    """The folder ``<base>-<suffix>``: ``base``'s files with the tensors ``tune(base's tensors)``
    returns, built once and atomically; concurrent builders (pytest-xdist workers) wait on
    `sample_models.build_lock` and find it built."""
    out = base.with_name(f"{base.name}-{suffix}")
    if (out / "config.json").exists():
        return out
    with build_lock(out.parent):
        if not (out / "config.json").exists():
            tmp = staging_copy(base, out)
            save_state_dict(tune(load_state_dict(base)), tmp)
            os.replace(tmp, out)
    return out


def changed_tensors(base: Path, tuned: Path) -> list[str]:
    """Names of the checkpoint tensors whose bytes differ between two folders."""
    a, b = load_state_dict(base), load_state_dict(tuned)
    return sorted(n for n in a if n not in b or not a[n].equal(b[n]))


def describe(name: str) -> dict:
    """The architecture's config and notes, for reports."""
    arch = ZOO[name]
    return {"name": name, "model_type": arch.config["model_type"], "auto_class": arch.auto_class, "kind": arch.kind,
            "notes": arch.notes, "config": json.loads(json.dumps(arch.config))}


# measuring one architecture ---------------------------------------------------------------------
EXPECTED_PATH = {"first": "none", "second": "full", "last-layers": "modules", "embeddings": "modules"}
def _outputs(engine, arch: Arch):
    return engine.generate() if arch.kind == "generate" else engine.embed()


def _recipes(signature: str) -> list[dict]:
    """The registry's recipes for ``signature`` in the default share group: per recipe, the
    modules it cannot replay (name -> why), whether it is replayable as a whole, and the
    checkpoint tensors no recorded module got."""
    from vllm_dedup.registry.wire import socket_path

    from vllm_dedup.engine.recipe import Recipe
    from vllm_dedup.registry.client import RegistryClient

    with RegistryClient(socket_path(), timeout_s=10) as client:
        client.hello("zoo-inspector", "inspector", "default", signature)
        raw = client.get_recipes(signature)
    out = []
    for data in raw:
        r = Recipe.from_bytes(data)
        out.append({"modules": len(r.modules), "replayable": r.replayable, "why": r.why,
                    "unreplayable": {n: m.why for n, m in sorted(r.modules.items()) if not m.replayable},
                    "unattributed": r.unattributed})
    return out


def _engine_row(engine, arch: Arch, role: str, reference: dict | None, outputs_to_match) -> dict:
    """Load path, oracle verdict and outputs of one running dedup engine."""
    from harness.oracle import differences
    from vllm_dedup.registry.client import registry_stats

    stats = registry_stats().engine(engine.pid)
    load = dict(stats.load)
    row = {"role": role, "expected_path": EXPECTED_PATH[role], "path": load.get("load_path", "?"),
           "checkpoint_bytes_read": load.get("checkpoint_bytes_read"), "shared_bytes": load.get("shared_bytes"),
           "published_bytes": load.get("published_bytes"), "load_seconds": load.get("load_seconds"),
           # vLLM's get_model, timed by the harness as for a plain engine (`EngineProcess.load_stats`)
           "get_model_s": engine.load_stats()["seconds"], "signature": stats.signature}
    (tensors,) = engine.final_tensors()
    row["meta_tensors"] = sorted(n for n, d in tensors.items() if d.endswith("|meta"))
    row["differences"] = differences(tensors, reference) if reference is not None else []
    outputs = _outputs(engine, arch)
    row["outputs"] = outputs
    row["outputs_equal"] = outputs_to_match is None or outputs == outputs_to_match
    row["log"] = dedup_log_lines(engine.log())
    return row


def verdict(row: dict) -> str:
    """``equal`` (the path expected, final tensors the reference's), ``declined`` (another
    path, final tensors the reference's), ``DIFFERENT`` (some final tensor is not the
    reference's) or ``CRASHED`` (the engine did not start or answer)."""
    if row.get("error"):
        return "CRASHED"
    if row["differences"]:
        return "DIFFERENT"
    return "equal" if row["path"] == row["expected_path"] else "declined"


def run_arch(name: str, workdir: Path, plain: bool = True, embeddings: bool | None = None,
             timeout_s: float = 600) -> dict:
    """Every engine the zoo runs for one architecture, one at a time (two at most: the first
    dedup engine stays up while the second and the fine-tune's map from it):

    1. ``plain``: ``--load-format auto`` (does vLLM's CPU backend serve it at all?), unless
       ``plain`` is False;
    2. the references (`references.reference_options`) of the base checkpoint and of its `last_layers`
       fine-tune: final tensors and outputs;
    3. ``first``: the first dedup engine of the base (path ``none``);
    4. ``second``: a second dedup engine of the base while the first is up (path ``full``);
    5. ``last-layers``: a dedup engine of the fine-tune while the first is up (path ``modules``);
    6. ``embeddings``: the same for `embeddings_tune` (``embeddings``: None as the architecture
       says, else run it or not).

    Each dedup engine's row says its load path, the final tensors that differ from its
    reference's, meta tensors left in it, whether its outputs (greedy token ids, or pooled
    outputs' digests) equal those of the first dedup engine (``second``) or of its reference
    (``first``, ``last-layers``), and what its log says of vllm-dedup.  The engines use a
    registry of their own (a runtime dir under ``workdir``, stopped at the end).
    """
    import time

    from harness.engines import EngineProcess
    from harness.oracle import differences
    from harness.procs import ChildExited
    from vllm_dedup.registry.client import shutdown_registry

    arch = ZOO[name]
    workdir = Path(workdir)
    result: dict = {**describe(name), "engines": {}, "errors": []}
    began = time.monotonic()
    try:
        base = checkpoint(name)
        tunes = {"last-layers": last_layers(base)}
        if arch.embeddings_tune if embeddings is None else embeddings:
            tunes["embeddings"] = embeddings_tune(base)
    except Exception as e:  # a config transformers cannot build here
        result["errors"].append(f"checkpoint: {type(e).__name__}: {e}")
        return result
    result["checkpoints"] = {"base": str(base), **{k: str(v) for k, v in tunes.items()}}
    result["changed_tensors"] = changed_tensors(base, tunes["last-layers"])
    if "embeddings" in tunes:
        result["changed_tensors_embeddings"] = changed_tensors(base, tunes["embeddings"])
    run_dir = workdir / name / "run"
    previous = os.environ.get("VLLM_DEDUP_RUNTIME_DIR")
    os.environ["VLLM_DEDUP_RUNTIME_DIR"] = str(run_dir)
    engines: list = []

    def start(model, load_format="dedup", extra=None, core=0):
        engine = EngineProcess(model, load_format, extra=extra, core=core, dtype=arch.dtype)
        engines.append(engine)
        try:
            return engine.wait_ready(timeout_s)
        except (ChildExited, TimeoutError) as e:
            tail = [line for line in engine.log().splitlines() if line.strip()][-15:]
            engine.stop()
            raise RuntimeError(f"{type(e).__name__}: " + "\n".join(tail)) from None

    def stop(engine):
        engine.stop()
        engines.remove(engine)

    try:
        if plain:
            try:
                e = start(base, "auto")
                result["plain"] = {"serves": True, "outputs": _outputs(e, arch),
                                   "get_model_s": e.load_stats()["seconds"]}
                stop(e)
            except Exception as e:  # recorded; the dedup engines are compared with their references anyway
                result["plain"] = {"serves": False, "error": str(e)[-3000:]}
        refs = {}
        for which, model in (("base", base), *tunes.items()):
            try:
                e = start(model, extra=reference_options())
                (tensors,) = e.final_tensors()
                refs[which] = {"tensors": tensors, "outputs": _outputs(e, arch), "log": dedup_log_lines(e.log())}
                stop(e)
            except Exception as e:
                result["errors"].append(f"reference {which}: {e}"[-3000:])
                return result
        result["reference"] = {k: {"outputs": v["outputs"], "tensors": len(v["tensors"]),
                                   "meta_tensors": sorted(n for n, d in v["tensors"].items() if d.endswith("|meta"))}
                               for k, v in refs.items()}
        # What the oracle sees of the fine-tune: a modules path that mapped the base's changed
        # layers would show exactly these names as differences.
        result["reference"]["base_vs_last_layers"] = sorted(
            d.split(":", 2)[0] + ":" + d.split(":", 2)[1]
            for d in differences(refs["last-layers"]["tensors"], refs["base"]["tensors"]))
        if plain and "outputs" in result["plain"]:
            result["plain"]["outputs_equal_reference"] = result["plain"]["outputs"] == refs["base"]["outputs"]
        rows = result["engines"]
        for role, model, core in (("first", base, 0), ("second", base, 1), *((k, v, 1) for k, v in tunes.items())):
            ref = refs[role if role in tunes else "base"]
            try:
                engine = start(model, core=core)
            except Exception as e:
                rows[role] = {"role": role, "expected_path": EXPECTED_PATH[role], "error": str(e)[-3000:]}
                if role == "first":
                    break
                continue
            try:
                match = rows["first"]["outputs"] if role == "second" else ref["outputs"]
                rows[role] = _engine_row(engine, arch, role, ref["tensors"], match)
            except Exception as e:  # the engine died answering (a crash at the first forward pass)
                rows[role] = {"role": role, "expected_path": EXPECTED_PATH[role],
                              "error": f"{type(e).__name__}: {str(e)[-3000:]}",
                              "log": dedup_log_lines(engine.log())}
                if role == "first":  # nothing to map from or compare with: the others are not run
                    break
            if role == "first":  # stays up: the next two map from it
                try:
                    result["recipes"] = _recipes(rows["first"]["signature"]) if "signature" in rows["first"] else []
                except Exception as e:
                    result["errors"].append(f"recipes: {type(e).__name__}: {e}")
            else:
                stop(engine)
        for row in rows.values():
            row["verdict"] = verdict(row)
    finally:
        for e in list(engines):
            e.stop()
        shutdown_registry()
        if previous is None:
            os.environ.pop("VLLM_DEDUP_RUNTIME_DIR", None)
        else:
            os.environ["VLLM_DEDUP_RUNTIME_DIR"] = previous
        result["seconds"] = round(time.monotonic() - began, 1)
    return result
