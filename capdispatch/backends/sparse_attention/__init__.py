"""The sparse-attention Triton kernels shared by two ops: ``sparse_prefill`` (bf16 K/V rows)
and ``decode_mla`` (the V4 fp8 paged pool, uint8 or native-fp8 reads). Not an op package:
it declares nothing; each op's ``triton_kernels.py`` arranges its arguments and launches
these kernels.

Public surface (everything else here is private to this package):

``kernels`` (imports triton; import it when a backend is bound)
    ``plan_launch(device, kind, T, H, consts, *, config=None, num_splits=1, n_idx=0, n_idx2=0)``:
    the ``LaunchPlan`` of one call shape (configurations to try, split-K count and scratch,
    constexprs and launch options), which the op keeps per (device, shape);
    ``launch_planned(plan, T, head, DIV, LEN_DIV, qk_scale, device)``: launch the kernel (and
    the split-K combine) with the op's pointers and strides (``head``, positional), trying
    the plan's configurations until one fits the device, returning the plan that ran;
    ``device_configs(device, kind, tokens)``: the configurations, best first;
    ``forget_plans()``: drop the configuration choices (tuning);
    ``decode_splits`` / ``plan_splits``: the split-K factor of a decode-sized call;
    ``check_device``, ``device_key``, ``num_sms``, ``INTERPRETED``, ``OUT_OF_RESOURCES``, ``DIM``;
    offline compiles without a GPU: ``compile_signature``, ``COMPILE_SIGNATURES``,
    ``compile_offline``, ``compile_combine_offline``.
``launch_table`` (plain Python)
    ``configs_for(cc, kind, tokens)`` over ``MEASURED_CONFIGS`` / ``PORTABLE_CONFIGS`` per
    call kind (``KINDS``: "prefill", "decode", "decode_split"), ``INTERP_CONFIG``, and the
    split-K and combine constants.

The kernels themselves (``kernels._sparse_mla_kernel``, ``kernels._combine_kernel``) are
named by ``"module:function"`` strings in the compile matrix, as every op's kernels are.

This ``__init__`` imports nothing, so that reading the launch table pulls in neither
torch nor triton, and so that a test that reloads ``kernels`` under the interpreter
leaves no stale copy of its functions here.
"""

__all__ = ["kernels", "launch_table"]
