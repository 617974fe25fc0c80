"""ndparallel.training.metrics: the FLOPs formula against a hand count, StepTimer's arithmetic, the CPU peak
estimate."""

import pytest
import torch
import transformers

from ndparallel import Accelerator
from ndparallel.training.metrics import StepTimer, flops_per_token, matmul_params, peak_flops, timer_for

TINY = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, tie_word_embeddings=False)


def test_flops_per_token_matches_a_hand_count():
    config = transformers.LlamaConfig(**TINY)
    # Per layer: q 8x8 + o 8x8 + k 8x4 + v 8x4 (one KV head of dim 4) = 192; gate, up, down 3 x 8x16 = 384.
    # Two layers: 1152; LM head 8x10 = 80; the input embedding is a lookup and is not counted.
    assert matmul_params(config) == 1232
    # 6 x 1232 + 12 x 2 layers x (2 heads x 4) x seq 5 = 7392 + 960.
    assert flops_per_token(config, seq_len=5) == 8352


def test_matmul_params_are_the_linear_weights_of_the_model():
    config = transformers.LlamaConfig(**TINY)
    model = transformers.LlamaForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(config) == linear


def test_a_mixture_of_experts_counts_the_experts_a_token_goes_to():
    """Qwen3-MoE, hidden 64, 4 heads of 16, 2 KV heads, 8 experts of intermediate 32, top 2, 2 layers, vocab 100."""
    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=100)
    # Per layer: q, o 64x64 each, k, v 64x32 each = 12,288; the router 64x8 = 512; two experts' gate, up and down
    # 2 x 3 x 64x32 = 12,288 (not the dense intermediate_size, which no layer of this config uses). Two layers 50,176,
    # the head 6,400: 56,576. 6 x 56,576 + 12 x 2 layers x 64 x seq 16 = 339,456 + 24,576.
    assert flops_per_token(config, seq_len=16) == 364_032
    # The count is the model's: the dense formula would have counted a 64x128 gated MLP per layer.
    model = transformers.Qwen3MoeForCausalLM(config)
    experts = model.model.layers[0].mlp.experts
    per_expert = sum(p.numel() for p in experts.parameters()) // 8
    assert per_expert == 3 * 64 * 32


def test_flops_per_token_needs_a_decoder_config():
    with pytest.raises(ValueError, match="hidden_size"):
        flops_per_token(object(), seq_len=4)


def test_step_timer_medians_tokens_per_second_and_mfu():
    timer = StepTimer(flops_per_token=100.0, peak_flops=1000.0, num_devices=2)
    for seconds in (5.0, 1.0, 2.0, 4.0):  # the first is warm-up
        timer.record(seconds, tokens=40)
    assert timer.last == {"step_time_s": 4.0, "tokens_per_s": 10.0, "mfu": 10.0 * 100 / 2000}
    assert timer.postfix() == {"s/step": "4.000", "tok/s": "10", "mfu": "50.0%"}
    summary = timer.summary(skip=1)
    assert summary["step_time_s"] == 2.0 and summary["tokens_per_s"] == 20.0 and summary["steps"] == 3
    assert summary["mfu"] == pytest.approx(20.0 * 100 / 2000)
    with timer.step(tokens=3):
        pass
    assert len(timer.times) == 5 and timer.tokens[-1] == 3


def test_step_timer_without_peak_reports_no_mfu_and_refuses_empty_summaries():
    timer = StepTimer()
    with pytest.raises(ValueError, match="no step timed"):
        timer.last
    timer.record(0.5, tokens=10)
    assert timer.last["mfu"] is None and "mfu" not in timer.postfix()
    with pytest.raises(ValueError, match="no steps after skipping 1 of 1"):
        timer.summary(skip=1)
    with pytest.raises(ValueError, match="positive"):
        timer.record(0.0, tokens=1)
    with pytest.raises(ValueError, match="num_devices"):
        StepTimer(num_devices=0)


def test_cpu_peak_is_a_measured_estimate():
    value, source = peak_flops("cpu")
    assert value > 0 and source.startswith("estimate:")


def _step_timer_in_a_rank() -> tuple:
    accelerator = Accelerator(cpu=True)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    timer = accelerator.step_timer(model, seq_len=5, peak_flops=1e9)
    without_model = timer_for(accelerator).flops_per_token
    accelerator.end_training()
    return timer.flops_per_token, timer.peak_flops, timer.num_devices, without_model


def test_accelerator_step_timer_takes_flops_from_the_model_config():
    # In a forked rank: an Accelerator initialises torch.distributed, which the pytest process must never do
    # (ranks forked later from a process with a live gloo group hang).
    from harness import run_ranks

    assert run_ranks(_step_timer_in_a_rank, 1) == [(8352, 1e9, 1, None)]
