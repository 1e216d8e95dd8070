"""Hugging Face models end to end: a Llama saved with ``save_pretrained`` loads into a
meta-built sharded model (``load_safetensors``; row-sparse tables too), exports back for
``from_pretrained`` (``export_safetensors``), and ``generate`` works when ranks stop at
different lengths; LoRA through peft; row-sparse tables on GPT-2, T5 and a LoRA-adapted
table."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import flatshard
from flatshard.cli.main import main
from flatshard.testing.isolated import run_isolated
from flatshard.testing.models import TINY_LLAMA
from flatshard.testing.workers import WorkerContext, WorkerPool
from in_process import train

transformers = pytest.importorskip("transformers")

SEED = 3


LLAMA = TINY_LLAMA


def llama_job(
    ctx: WorkerContext, world: int, directory: str, sparse: bool
) -> dict[str, Any] | None:
    """docs/guide.md's recipe: build on meta, shard with skip_init (which builds the rotary
    embedding again from its config: its buffers are in no checkpoint), load."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    group = ctx.group(world)
    if group is None:
        return None
    config = LlamaConfig(**LLAMA)
    options: dict[str, Any] = {"auto_wrap_policy": {LlamaDecoderLayer}, "process_group": group}
    options |= {"param_init_fn": flatshard.skip_init, "device": "cpu"}
    options |= {"placement": flatshard.RowSparse() if sparse else None}
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    flatshard.fully_shard(model, **options)
    flatshard.load_safetensors(model, directory)
    with torch.no_grad():
        logits = model(torch.arange(12).reshape(2, 6)).logits
    lookups = sum(t.lookups for t in flatshard.embedding_traffic(model).values())
    assert lookups == (1 if sparse else 0), lookups
    try:
        model.save_pretrained(f"{directory}/plain-{world}")
        plain = "no error"
    except RuntimeError as error:
        plain = str(error)
    exported = f"{directory}/export-{world}"
    flatshard.export_safetensors(model, exported)
    reloaded = None
    if ctx.rank == 0:
        with torch.no_grad():
            reloaded = LlamaForCausalLM.from_pretrained(exported)(torch.arange(12).reshape(2, 6))
    return {"logits": logits, "plain": plain, "reloaded": reloaded}


@pytest.mark.parametrize(
    ("world", "sparse"), [(2, False), (3, False), (2, True)], ids=["2", "3", "2-sparse"]
)
def test_a_hugging_face_llama_loads_from_save_pretrained(
    pool: WorkerPool, tmp_path: Path, world: int, sparse: bool
) -> None:
    torch.manual_seed(SEED)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    reference.save_pretrained(tmp_path, max_shard_size="20KB")  # several files and an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    with torch.no_grad():
        expected = reference(torch.arange(12).reshape(2, 6)).logits
    results = pool.run(llama_job, world, str(tmp_path), sparse)[:world]
    for result in results:
        torch.testing.assert_close(result["logits"], expected, rtol=1e-6, atol=0)
        assert "For save_pretrained use flatshard.export_safetensors" in result["plain"]
    # export_safetensors is save_pretrained for a sharded model: from_pretrained loads it.
    assert torch.equal(results[0]["reloaded"].logits, expected)


def generate_job(ctx: WorkerContext, directory: str, sparse: bool) -> list[int]:
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    group = ctx.group(ctx.world_size)  # transformers syncs over the default group: the world
    assert group is not None
    model = LlamaForCausalLM.from_pretrained(directory)
    flatshard.fully_shard(
        model,
        auto_wrap_policy={LlamaDecoderLayer},
        process_group=group,
        placement=flatshard.RowSparse() if sparse else None,
    )
    prompt = torch.arange(4).reshape(1, 4) + 3 * ctx.rank
    # Rank 0 stops after 2 new tokens, rank 1 after 4, ...: transformers keeps the ranks
    # that are done running forwards (synced_gpus) until the last is, since fully_shard
    # marks the model.
    out = model.generate(prompt, max_new_tokens=2 + 2 * ctx.rank, do_sample=False)
    lookups = sum(t.lookups for t in flatshard.embedding_traffic(model).values())
    assert (lookups > 0) == sparse, lookups  # each decoding step's token fetched as a row
    return [int(t) for t in out[0]]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse_embeddings"])
def test_generate_with_different_stop_lengths_per_rank(
    pool: WorkerPool, tmp_path: Path, sparse: bool
) -> None:
    torch.manual_seed(SEED)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    reference.save_pretrained(tmp_path)
    for rank, tokens in enumerate(pool.run(generate_job, str(tmp_path), sparse)):
        prompt = torch.arange(4).reshape(1, 4) + 3 * rank
        expected = reference.generate(prompt, max_new_tokens=2 + 2 * rank, do_sample=False)
        assert tokens == [int(t) for t in expected[0]], rank


def test_train_with_lora_exports_the_merged_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--init pretrained --lora``: peft's adapters train on the sharded pretrained base
    (loaded under peft's names; the checkpoint in several files; activation checkpointing
    on), and the export is the
    base with the adapters merged: the same tensors as the final checkpoint merged by peft
    on one process, the untargeted weights bit-identical to the pretrained ones (the load
    is exact), and so are the targeted ones of layer 0, whose adapters ``--freeze`` keeps."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(**{**LLAMA, "vocab_size": 300})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "pre", max_shard_size="40KB")
    out = tmp_path / "run"
    argv = ["--model", f"hf:{tmp_path / 'pre'}", "--init", "pretrained", "--steps", "3"]
    argv += ["--lora", "r=4,alpha=8,targets=q_proj,v_proj", "--lr", "1e-2", "--ckpt-every", "3"]
    argv += ["--freeze", "*.layers.0.*lora_*", "--checkpoint-activations"]
    argv += ["--seq-len", "16", "--batch", "2", "--sample-bytes", "0", "--out-dir", str(out)]
    stdout = train(*argv)  # (in this process: tests/in_process.py)
    pretrained = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "pre").state_dict()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    reference = get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "pre"), lora
    )
    flatshard.load_checkpoint(out / "checkpoints" / "step_000003", reference)
    merged = reference.merge_and_unload().state_dict()
    exported = transformers.LlamaForCausalLM.from_pretrained(out / "hf_model").state_dict()
    assert exported.keys() == pretrained.keys()
    for key, value in exported.items():
        assert torch.equal(value, merged[key]), key
        targeted = key.endswith(("q_proj.weight", "v_proj.weight")) and ".layers.0." not in key
        assert torch.equal(value, pretrained[key]) != targeted, key  # only adapters moved
    # Trained with checkpointing and without a key-value cache, yet the exported config
    # keeps the cache on, as the pretrained one had it: generation after from_pretrained
    # reads it.
    assert json.loads((out / "hf_model" / "config.json").read_text())["use_cache"] is True
    # The checkpoint as saved holds peft's names: its export is refused, with the recipe.
    assert "pretrained weights" in stdout
    assert main(["ckpt", "export", str(out / "checkpoints" / "step_000003"), str(tmp_path)]) == 2
    assert "holds LoRA adapters" in capsys.readouterr().err


T5 = {"vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4}


def t5_job(ctx: WorkerContext, world: int, directory: str) -> torch.Tensor | None:
    """An encoder-decoder whose embedding is tied three ways (shared, encoder, decoder)."""
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    group = ctx.group(world)
    if group is None:
        return None
    with torch.device("meta"):
        model = T5ForConditionalGeneration(T5Config(**T5, decoder_start_token_id=0))
    flatshard.fully_shard(
        model,
        auto_wrap_policy={T5Block},
        process_group=group,
        param_init_fn=flatshard.skip_init,
        device="cpu",
    )
    flatshard.load_safetensors(model, directory)
    model.eval()  # as from_pretrained leaves it: no dropout
    with torch.no_grad():
        out: torch.Tensor = model(**_t5_inputs()).logits
    return out


def _t5_inputs() -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.arange(10).reshape(2, 5),
        "decoder_input_ids": torch.arange(8).reshape(2, 4),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_a_t5_loads_from_save_pretrained(pool: WorkerPool, tmp_path: Path, world: int) -> None:
    torch.manual_seed(SEED)
    config = transformers.T5Config(**T5, decoder_start_token_id=0)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path, max_shard_size="30KB")
    reference = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path)
    with torch.no_grad():
        expected = reference(**_t5_inputs()).logits
    for logits in pool.run(t5_job, world, str(tmp_path))[:world]:
        # Computed in another process with one thread: sums in another order.
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def _lora_llama() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    return get_peft_model(base, lora)


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return loss


def lora_job(ctx: WorkerContext, out_dir: str) -> dict[str, Any]:
    """peft then fully_shard (the recipe) against the same peft model unsharded, 3 steps of
    AdamW on one global batch of 4 (2 per rank); the result exported for from_pretrained
    (full state dict, LoRA merged on rank 0); then get_peft_model after fully_shard."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    group = ctx.group(2)
    assert group is not None or ctx.rank >= 2
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    reference, model = _lora_llama(), _lora_llama()
    if group is None:
        return {}
    flatshard.fully_shard(model, auto_wrap_policy={LlamaDecoderLayer}, process_group=group)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    mine = ids[2 * ctx.rank : 2 * ctx.rank + 2]
    for _ in range(3):
        for net, batch, optim in zip((reference, model), (ids, mine), optims, strict=True):
            _lm_loss(net, batch).backward()
            optim.step()
            optim.zero_grad(set_to_none=False)
    base_grads = [p.grad for n, p in model.named_parameters() if "lora_" not in n]
    full = flatshard.full_state_dict(model)
    with torch.no_grad():
        live = model(input_ids=ids).logits
    exported = direct = None
    if ctx.rank == 0:  # the export recipe: full state dict, merged into the base, saved
        merged = _lora_llama()
        merged.load_state_dict(full)
        merged.merge_and_unload().save_pretrained(out_dir)
        with torch.no_grad():
            exported = transformers.LlamaForCausalLM.from_pretrained(out_dir)(ids).logits
    # export_safetensors of the peft model itself: the base model it computes
    flatshard.export_safetensors(model, f"{out_dir}/direct")
    with torch.no_grad():
        after = model(input_ids=ids).logits  # the live model unchanged by the export
        if ctx.rank == 0:
            direct = transformers.LlamaForCausalLM.from_pretrained(f"{out_dir}/direct")(ids).logits
    return {
        "live": live,
        "after": after,
        "exported": exported,
        "direct": direct,
        "full": full,
        "expected": reference.state_dict(),
        "frozen_without_grad": all(g is None for g in base_grads),
        "late": _peft_after_fully_shard(group, ids),
    }


def _peft_after_fully_shard(group: Any, ids: torch.Tensor) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(SEED)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    flatshard.fully_shard(base, auto_wrap_policy={LlamaDecoderLayer}, process_group=group)
    late = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    try:
        _lm_loss(late, ids).backward()
    except (RuntimeError, ValueError) as error:
        return str(error)
    return "no error"


def peft_copies_job(ctx: WorkerContext, out_dir: str) -> dict[str, Any] | None:
    """A peft classifier (SEQ_CLS: peft trains a copy of the head, ``modules_to_save``)
    exported and reloaded; a LoRA adapter on a head tied to the embedding, refused."""
    from peft import LoraConfig, get_peft_model
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    group = ctx.group(2)
    if group is None:
        return None
    torch.manual_seed(SEED)
    base = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(**LLAMA, num_labels=3, pad_token_id=0)
    )
    plain = transformers.LlamaForSequenceClassification(base.config)
    plain.load_state_dict(base.state_dict())  # the base model, before peft wraps it
    lora = LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora)
    with torch.no_grad():  # the trained copy of the head, not the original
        model.base_model.model.score.modules_to_save["default"].weight.add_(1.0)
    flatshard.fully_shard(model, auto_wrap_policy={LlamaDecoderLayer}, process_group=group)
    ids = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    flatshard.export_safetensors(model, out_dir)
    with model.disable_adapter():  # what the model computes there: the base model
        flatshard.export_safetensors(model, f"{out_dir}/disabled")
    with torch.no_grad():
        live = model(input_ids=ids).logits
        with model.disable_adapter():  # peft flips requires_grad: no gradient, no refusal
            live_off = model(input_ids=ids).logits
        exported = disabled = base_logits = None
        if ctx.rank == 0:
            reloaded = transformers.LlamaForSequenceClassification.from_pretrained(out_dir)
            exported = reloaded(input_ids=ids).logits
            off = transformers.LlamaForSequenceClassification.from_pretrained(f"{out_dir}/disabled")
            disabled, base_logits = off(input_ids=ids).logits, plain(input_ids=ids).logits
    apart = model.disable_adapter() if ctx.rank == 0 else contextlib.nullcontext()
    try:
        with apart:  # on one rank only: the file would be rank 0's choice alone
            flatshard.export_safetensors(model, f"{out_dir}/apart")
        one_rank = "no error"
    except ValueError as error:
        one_rank = str(error)
    torch.manual_seed(SEED)
    tied = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True)
    )
    tied = get_peft_model(tied, LoraConfig(r=4, target_modules=["lm_head"]))
    flatshard.fully_shard(tied, auto_wrap_policy={LlamaDecoderLayer}, process_group=group)
    try:
        flatshard.export_safetensors(tied, f"{out_dir}/tied")
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    return {
        "live": live,
        "live_off": live_off,
        "exported": exported,
        "disabled": disabled,
        "base": base_logits,
        "refused": refused,
        "one_rank": one_rank,
    }


def test_a_peft_models_trained_copies_are_exported_and_tied_adapters_refused(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """Before: the head's copy written as 'score.modules_to_save.default.weight' (a random
    head after from_pretrained), and a tied head's delta written into the embedding too."""
    pytest.importorskip("peft")
    results = pool.run(peft_copies_job, str(tmp_path))[:2]
    torch.testing.assert_close(results[0]["exported"], results[0]["live"], rtol=1e-5, atol=1e-5)
    # inside peft's disable_adapter(): the base model (before, the adapters merged anyway)
    torch.testing.assert_close(results[0]["disabled"], results[0]["base"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0]["live_off"], results[0]["base"], rtol=1e-5, atol=1e-5)
    for result in results:
        assert "holds a LoRA adapter on a weight tied to another" in result["refused"]
        assert "would merge other adapters" in result["one_rank"], result["one_rank"]


def test_lora_with_peft_then_fully_shard_matches_unsharded(
    pool: WorkerPool, tmp_path: Path
) -> None:
    pytest.importorskip("peft")
    results = pool.run(lora_job, str(tmp_path))[:2]
    for result in results:
        assert result["frozen_without_grad"]  # the base is frozen: no gradient, no reduction
        assert "after fully_shard" in result["late"], result["late"]
    for key, value in results[0]["expected"].items():  # full state dicts live on rank 0
        torch.testing.assert_close(results[0]["full"][key], value, rtol=1e-5, atol=1e-6)
    # Fine-tuned, exported, reloaded with from_pretrained: the live model's logits.
    torch.testing.assert_close(results[0]["exported"], results[0]["live"], rtol=1e-5, atol=1e-5)
    # The same from export_safetensors of the peft model (before: peft's names, which
    # from_pretrained matched to nothing: a random model, and no error).
    torch.testing.assert_close(results[0]["direct"], results[0]["live"], rtol=1e-5, atol=1e-5)
    for result in results:
        assert torch.equal(result["after"], result["live"])


def peft_generate_job(rank: int) -> dict[str, Any]:
    """A sharded peft model's own ``generate``, called as on a plain model (no entry point
    registered), where rank 0 meets its end-of-sequence token first: the tokens the same
    peft model generates unsharded, and the ranks still in step for a training step. In
    a world of its own: transformers keeps the ranks in step on the default group."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    reference, model = _lora_llama(), _lora_llama()
    flatshard.fully_shard(model, auto_wrap_policy={LlamaDecoderLayer})
    prompts = [torch.tensor([[0, 5, 7, 9]]), torch.tensor([[0, 3, 2, 8]])]
    options = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 1}
    with torch.no_grad():
        free = [reference.generate(p, eos_token_id=None, **options)[0, 4:] for p in prompts]
        # a token rank 0 generates early and rank 1 never: rank 0 stops first
        eos = next(int(t) for t in free[0][:3] if t not in free[1])
        expected = reference.generate(prompts[rank], eos_token_id=eos, **options)
        sharded = model.generate(prompts[rank], eos_token_id=eos, **options)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    _lm_loss(model, ids).backward()  # the next collectives still pair up
    return {"expected": expected[0].tolist(), "sharded": sharded[0].tolist()}


def test_a_peft_models_generate_runs_sharded_when_ranks_stop_apart() -> None:
    """Before: refused ("ran while its unit '<root>' is sharded": peft's generate calls the
    model it wraps, not the root's forward), and once registered as an entry point, gloo's
    abort when rank 0 stopped first (transformers looked for the lockstep mark on the
    inner model)."""
    pytest.importorskip("peft")
    results = run_isolated(peft_generate_job)
    assert all(isinstance(r, dict) for r in results), results
    assert len(results[0]["expected"]) < len(results[1]["expected"])  # ragged, as meant
    for result in results:
        assert result["sharded"] == result["expected"]


def gathered_generate_job(
    ctx: WorkerContext, directory: str, sparse: bool
) -> dict[str, Any] | None:
    """generate inside summon_full_params on rank 0 only (the guide's decode-in-summon
    pattern, transformers' defaults): every unit stays gathered, no collective."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from flatshard.measure import CollectiveTracker

    group = ctx.group(2)
    if group is None:
        return None
    model = LlamaForCausalLM.from_pretrained(directory)
    flatshard.fully_shard(
        model,
        auto_wrap_policy={LlamaDecoderLayer},
        process_group=group,
        placement=flatshard.RowSparse() if sparse else None,
    )
    prompt = torch.arange(4).reshape(1, 4)
    summoned = flatshard.summon_full_params(model, writeback=False)
    with summoned, torch.no_grad(), CollectiveTracker() as tracker:
        out = model.generate(prompt, max_new_tokens=5, do_sample=False) if ctx.rank == 0 else None
    lockstep = bool(getattr(model, "_is_fsdp_managed_module", False))  # again, outside
    try:
        with flatshard.summon_full_params(model, writeback=False):
            model(prompt)
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    assert not any(t.lookups for t in flatshard.embedding_traffic(model).values())
    return {
        "tokens": None if out is None else [int(t) for t in out[0]],
        "bytes": sum(tracker.bytes.values()),
        "refused": refused,
        "lockstep": lockstep,
    }


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse_embeddings"])
def test_generate_inside_summon_gathers_nothing(
    pool: WorkerPool, tmp_path: Path, sparse: bool
) -> None:
    torch.manual_seed(SEED)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    reference.save_pretrained(tmp_path)
    expected = reference.generate(torch.arange(4).reshape(1, 4), max_new_tokens=5, do_sample=False)
    results = pool.run(gathered_generate_job, str(tmp_path), sparse)[:2]
    assert results[0]["tokens"] == [int(t) for t in expected[0]]
    for result in results:
        assert result["bytes"] == 0  # no collective at all while decoding (before: one
        # all-reduce per token, transformers' synced_gpus, which rank 1 never joined)
        assert result["lockstep"]
        assert "ran forward with gradients inside summon_full_params" in result["refused"]


def _vocab_model(kind: str) -> tuple[nn.Module, type[nn.Module]]:
    """A 1,000-token transformers model: GPT-2 (its token table tied to the head, and a
    position table), T5 (one table looked up by the encoder and the decoder and tied to the
    head; relative position tables inside the blocks), or a Llama with peft's LoRA on its
    token table (the base table frozen)."""
    from peft import LoraConfig, get_peft_model
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(SEED)
    if kind == "gpt2":
        no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        config = transformers.GPT2Config(
            vocab_size=1000, n_positions=16, n_embd=32, n_layer=2, n_head=2, **no_dropout
        )
        return transformers.GPT2LMHeadModel(config), GPT2Block
    if kind == "t5":
        from transformers.models.t5.modeling_t5 import T5Block

        t5 = transformers.T5Config(**{**T5, "vocab_size": 1000}, dropout_rate=0.0)
        t5.decoder_start_token_id = 0
        return transformers.T5ForConditionalGeneration(t5), T5Block
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, "vocab_size": 1000}))
    lora = LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], init_lora_weights=False)
    return get_peft_model(base, lora), LlamaDecoderLayer


def vocab_job(ctx: WorkerContext, kind: str) -> dict[str, Any]:
    """3 SGD steps with row-sparse tables against the unsharded model on the global batch."""
    group = ctx.group(2)
    (reference, _), (model, block) = _vocab_model(kind), _vocab_model(kind)
    if group is None:
        return {}
    flatshard.fully_shard(
        model, auto_wrap_policy={block}, process_group=group, placement=flatshard.RowSparse()
    )
    optims = [
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
        for m in (reference, model)
    ]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 1000, (4, 16), generator=gen)
        mine = ids[2 * ctx.rank : 2 * ctx.rank + 2]
        for net, batch, optim in zip((reference, model), (ids, mine), optims, strict=True):
            _lm_loss(net, batch).backward()
            optim.step()
            optim.zero_grad()
    traffic = flatshard.embedding_traffic(model)
    return {
        "lookups": {name: (t.lookups, t.dense_lookups) for name, t in traffic.items()},
        "full": flatshard.full_state_dict(model),
        "expected": reference.state_dict(),
    }


@pytest.mark.parametrize("kind", ["gpt2", "t5", "lora_on_the_table"])
def test_row_sparse_tables_of_transformers_models_match_unsharded(
    pool: WorkerPool, kind: str
) -> None:
    """GPT-2's and T5's tables, and a frozen Llama table under peft's LoRA, with
    placement=RowSparse(): the result the unsharded model's."""
    pytest.importorskip("peft")
    results = pool.run(vocab_job, kind)[:2]
    # (sparse, dense) lookups per table. GPT-2's 16 positions are all looked up by every
    # rank: the rows asked (8 each way) outweigh the table, so the rule keeps it dense.
    lookups = {
        "gpt2": {"transformer.wte.weight": (3, 0), "transformer.wpe.weight": (0, 3)},
        # T5's decoder looks the table up while its gather for the head is in flight: dense.
        "t5": {
            "shared.weight": (3, 3),
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": (3, 0),
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": (3, 0),
        },
        "lora_on_the_table": {"base_model.model.model.embed_tokens.base_layer.weight": (3, 0)},
    }[kind]
    for result in results:
        assert result["lookups"] == lookups, result["lookups"]
    expected = results[0]["expected"]
    assert sorted(results[0]["full"]) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(results[0]["full"][key], value, rtol=1e-5, atol=1e-6)
