"""gdn.hf.patch on small HF Qwen3.5 and Qwen3-Next models (CPU): the same greedy tokens and logits as HF's own
path, the cache holding the state, batches with left padding. Skipped without torch and transformers."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gdn  # noqa: E402
import gdn.hf  # noqa: E402

GDN_SHAPE = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
)


def qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            layer_types=["linear_attention", "full_attention", "linear_attention"],
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, **GDN_SHAPE)
    return Qwen3_5ForCausalLM(cfg)


def qwen3_next():
    mod = pytest.importorskip("transformers.models.qwen3_next")
    cfg = mod.Qwen3NextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                              num_key_value_heads=1, head_dim=32, num_experts=0, moe_intermediate_size=64,
                              shared_expert_intermediate_size=64, **GDN_SHAPE)
    return mod.Qwen3NextForCausalLM(cfg)


def randomise(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "dt_bias") and hasattr(m, "A_log"):
                m.dt_bias.normal_(0, 0.5)
                m.norm.weight.uniform_(0.5, 1.5)
    return model.eval()


def generate(model, ids, mask):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("make", [qwen3_5, qwen3_next], ids=["qwen3_5", "qwen3_next"])
def test_patched_generate_matches_hf(make):
    torch.manual_seed(1)
    model = randomise(make())
    ids = torch.randint(0, 128, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in one row
    ref_seq, ref_logits = generate(model, ids, mask)
    assert gdn.hf.patch(model) >= 1
    got_seq, got_logits = generate(model, ids, mask)
    assert torch.equal(got_seq, ref_seq)
    rel = ((got_logits - ref_logits).norm() / ref_logits.norm()).item()
    assert rel < 1e-5, rel
    gdn.hf.unpatch(model)
    again, _ = generate(model, ids, mask)
    assert torch.equal(again, ref_seq)


def test_patch_without_gdn_layers_is_an_error():
    with pytest.raises(ValueError, match="no Qwen3_5GatedDeltaNet"):
        gdn.hf.patch(torch.nn.Linear(2, 2))


def test_forward_without_cache_matches_hf():
    model = randomise(qwen3_5())
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        gdn.hf.patch(model)
        got = model(ids, use_cache=False).logits
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
