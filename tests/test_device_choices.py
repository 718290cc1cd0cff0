"""train_gpt.py's "Distributed setup and device choices" section: which kernels a device and a --compile mode get
(choose_kernels: FlexAttention compiled on its own when the model is not), the Runtime that setup_runtime decides on
a CPU (banded attention and the chunked head + loss, whose loss and gradients match the plain path's) and the host
allocator setting it records (keep_freed_host_memory), and the gradient accumulation that splits the global batch
over each world size (batch_schedule)."""
import pytest
import torch

import train_gpt as T
from test_model import rel_err, small_args, tokens_with_docs
from test_schedules import speedrun


@pytest.mark.torch_range
@pytest.mark.parametrize("compile_mode, alone", [("auto", False), ("model", False), ("loss", True), ("off", True)])
def test_flex_attention_is_compiled_on_its_own_when_the_model_is_not(monkeypatch, compile_mode, alone):
    """Uncompiled flex_attention builds the dense score matrix (58 GB per layer at 48K tokens): --compile=off or
    loss on a GPU, the first thing a user tries when compilation fails, must not run it eagerly."""
    args = T.parse_args(["--preset=speedrun", "--recipe=reference", f"--compile={compile_mode}"], cuda_available=True)
    kernels = T.choose_kernels(args, "cuda", fp8_capable=True)
    assert kernels["attention"] == "flex" and kernels["compile_attention"] is alone
    assert not T.choose_kernels(T.parse_args(["--preset=cpu"], False), "cpu", False)["compile_attention"]
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                   **{**kernels, "fp8_head": False, "chunked_loss": False})
    kernel = T.build_model(small_args(), rt).backend.kernel  # what the model's attention calls go through
    from torch.nn.attention.flex_attention import flex_attention
    assert (kernel is not flex_attention) is alone
    if alone:
        assert getattr(kernel, "_torchdynamo_orig_callable", None) is flex_attention


def test_cpu_runtime_selects_the_chunked_loss_and_the_model_matches_the_plain_one():
    args = small_args("--seq_len=256", "--zero_init=false")
    rt = T.setup_runtime(T.parse_args(["--preset=cpu"], False))
    assert rt.chunked_loss and rt.attention == "banded"
    tokens = tokens_with_docs(257, [0, 90])
    losses = []
    for chunked in (False, True):
        torch.manual_seed(0)
        model = T.GPT(T.ModelConfig.of(args), loss=T.LossPath(chunked=chunked))
        loss = model(tokens[:-1], tokens[1:], T.window_tensor(2))
        loss.backward()
        losses.append((loss.item(), model.lm_head.weight.grad.clone(), model.embed.weight.grad.float()))
    assert losses[1][0] == pytest.approx(losses[0][0], abs=1e-5)
    assert rel_err(losses[1][1], losses[0][1]) < 1e-2 and rel_err(losses[1][2], losses[0][2]) < 2e-2


def test_a_cpu_run_keeps_freed_memory_in_the_heap_unless_the_user_set_glibcs_variable(monkeypatch):
    """The suite runs on Linux (glibc), which reports each mallopt it accepts; a MALLOC_<name>_ the user exported
    is left to glibc."""
    assert T.keep_freed_host_memory() == \
        "glibc mmap_threshold=268435456,trim_threshold=1073741824,top_pad=268435456"
    monkeypatch.setenv("MALLOC_TOP_PAD_", "0")
    assert T.keep_freed_host_memory() == "glibc mmap_threshold=268435456,trim_threshold=1073741824"
    assert T.setup_runtime(T.parse_args(["--preset=cpu"], False)).host_malloc.startswith("glibc mmap_threshold=")


@pytest.mark.parametrize("world_size, accum", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_gradient_accumulation_keeps_global_batch(world_size, accum):
    args = speedrun()
    batches = T.batch_schedule(args, world_size)
    assert batches.stage_accum == (accum,) and batches.stage_tokens == (args.batch_tokens,)
    assert all(batches.accum(s) * world_size * args.seq_len == args.batch_tokens for s in (0, 885, 1770))
    assert batches.lr_scale(0) == 1.0 == batches.lr_scale(1770)


@pytest.mark.parametrize("world_size", [3, 5, 16])
def test_gradient_accumulation_refuses_impossible_world_size(world_size):
    with pytest.raises(T.UsageError) as e:
        T.batch_schedule(speedrun(), world_size)
    assert f"world size {world_size}" in str(e.value) and "[1, 2, 4, 8]" in str(e.value)


def test_flex_attention_off_cuda_is_refused_at_start_up():
    """--attention=flex on a CPU was accepted and failed with NotImplementedError at the first backward."""
    args = T.parse_args(["--preset=cpu", "--attention=flex"], False)
    with pytest.raises(T.UsageError, match=r"^--attention=flex needs a CUDA GPU and this run is on cpu: pass "
                                           r"--attention=banded \(or auto, which picks it off CUDA\)$"):
        T.choose_kernels(args, "cpu", fp8_capable=False)


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "2"}, "environment variable WORLD_SIZE=2 asks for a distributed run, but MASTER_ADDR is not set"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "localhost"}, "but MASTER_PORT is not set"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer in "
                                                                            "[1, 65535]"),
    ({"RANK": "abc"}, "environment variable RANK='abc' is not an integer in [0, 0]"),
    ({"WORLD_SIZE": "0"}, "environment variable WORLD_SIZE='0' is not an integer at least 1"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}, "RANK='2' is not an integer in [0, 1]"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' is not an integer in [0, 0]"),
])
def test_torchrun_s_environment_variables_are_checked_before_use(monkeypatch, env, message):
    """WORLD_SIZE=2 without MASTER_ADDR, RANK=abc and WORLD_SIZE=0 ended in tracebacks from int() or torch."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(T.UsageError) as e:
        T.join_process_group(T.parse_args(["--preset=cpu"], False))
    assert message in str(e.value) and "torchrun" in str(e.value) and "\n" not in str(e.value)
