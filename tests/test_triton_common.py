"""The shared Triton toolbox (backends/triton_common) and tensor-argument checks (backends/arg_checks)."""
import pytest
import torch

from capdispatch.backends import arg_checks as C
from capdispatch.errors import ArgumentError, ArgumentTypeError


def test_jit_module_builds_one_copy_per_mode(monkeypatch):
    import triton

    from capdispatch.backends.triton_common.env import interpreted, jit_module

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interp = jit_module("codec")
    assert jit_module("codec") is interp
    assert interpreted(interp.round_bf16) and interpreted(jit_module("v4_rows").load_rows)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled = jit_module("codec")
    assert compiled is not interp
    assert isinstance(compiled.round_bf16, triton.runtime.jit.JITFunction)
    # The row loader calls the codec of its own mode.
    assert isinstance(jit_module("v4_rows")._e4m3fn_bits_to_f32, triton.runtime.jit.JITFunction)


def test_check_device_names_need_and_found():
    from capdispatch.backends.triton_common.env import check_device

    t = torch.zeros(1)
    check_device(t, interpreted=True, kernels="Triton test kernels", native_fp8=True)
    with pytest.raises(ArgumentError, match=r"Triton test kernels need CUDA tensors, got tensors on cpu"):
        check_device(t, interpreted=False, kernels="Triton test kernels")


def test_arg_checks_say_need_and_found():
    x = torch.zeros(2, 3, dtype=torch.float16)
    assert C.tensor(x, "x") is x
    with pytest.raises(ArgumentTypeError, match="k must be a torch.Tensor, got list"):
        C.tensor([1], "k")
    with pytest.raises(ArgumentTypeError, match="x must be bfloat16, got torch.float16"):
        C.dtype_in(x, "x", (torch.bfloat16,))
    with pytest.raises(ArgumentTypeError, match="ids must be int32 or int64, got torch.float16"):
        C.index_dtype(x, "ids")
    assert C.index_dtype(torch.zeros(1, dtype=torch.int64), "ids").dtype == torch.int64
    with pytest.raises(ArgumentError, match=r"out is on cpu, q is on meta"):
        C.same_device(x, "out", torch.device("meta"), "q")
    with pytest.raises(ArgumentError, match=r"out's last dim must be unit-stride, got strides \(1, 3\)"):
        C.unit_last_stride(x.t(), "out")
    C.unit_last_stride(torch.zeros(0, 3).t(), "out")     # empty: nothing to read
    for bad in (float("nan"), float("inf"), True, "1.0"):
        with pytest.raises(ArgumentTypeError, match="sm_scale must be a finite Python float"):
            C.finite_float(bad, "sm_scale")
    assert C.finite_float(0.5, "sm_scale") == 0.5
