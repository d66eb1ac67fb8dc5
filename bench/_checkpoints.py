"""The benchmarks' synthetic checkpoints: random models of real architectures written as Hugging Face
checkpoints (save_pretrained, or safetensors files with an index where transformers cannot write the format),
each into a sibling folder renamed into place once whole, so a killed write is never reused; and the page
cache set warm or cold before a run."""
import json
import os

from _pagecache import resident


def write_checkpoint(path, layers):
    from transformers import Qwen3MoeConfig
    save_random_model(Qwen3MoeConfig(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=768,
                                     num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                     head_dim=64, num_experts=32, num_experts_per_tok=4, vocab_size=32000,
                                     tie_word_embeddings=False), path)


def save_random_model(cfg, path):
    """A bf16 model of `cfg` (seed 0) by save_pretrained into a sibling folder, renamed into place once
    whole: a killed write is not reused."""
    import shutil
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size="500MB")
    partial.rename(path)


def write_gpt_oss_mxfp4(path, layers):
    """gpt-oss-20b's widths (hidden and expert 2880, 32 experts; vocabulary cut to 32000) with its experts
    as MXFP4 pairs, random blocks and scales in gpt-oss's exponent range, everything else bf16 from
    save_pretrained, quantization_config {quant_method: mxfp4}; renamed into place once whole."""
    import shutil
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GptOssConfig
    cfg = GptOssConfig(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                       head_dim=64, num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8,
                       vocab_size=32000, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    g = torch.Generator().manual_seed(1)
    weight_map, shard, index, at = {}, {}, 0, 0

    def flush():
        nonlocal shard, index, at
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(partial / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, index, at = {}, index + 1, 0
    for key, p in meta.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, n_in, n_out = p.shape  # the model's [E, in, out]
            tensors = {key + "_blocks": torch.randint(0, 256, (experts, n_out, n_in // 32, 16), generator=g,
                                                      dtype=torch.uint8),
                       key + "_scales": torch.randint(116, 130, (experts, n_out, n_in // 32), generator=g,
                                                      dtype=torch.uint8)}
        else:
            tensors = {key: (torch.randn(p.shape, generator=g) * 0.02).to(p.dtype)}
        for k, t in tensors.items():
            shard[k] = t
            at += t.numel() * t.element_size()
        if at >= 500_000_000:
            flush()
    flush()
    (partial / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = cfg.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    config["architectures"] = ["GptOssForCausalLM"]
    (partial / "config.json").write_text(json.dumps(config))
    partial.rename(path)


def set_page_cache(files, cold):
    """Evicts the files from the page cache (cold) or reads them into it (warm); returns the bytes
    resident afterwards (mincore)."""
    buf = bytearray(64 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fd:
            if cold:
                os.posix_fadvise(fd.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while fd.readinto(buf):
                    pass
    return resident(files)[0]
