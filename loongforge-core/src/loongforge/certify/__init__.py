"""``loongforge certify``: prove that a device backend trains as the CPU reference does, and say how far it is.

A device that "runs" can still be wrong: a reduction that skips a rank, a fused kernel with a wrong backward, a
matmul that accumulates in low precision all give a loss that falls. Certification trains the same recipe on the
backend and on the CPU reference and compares what each step computed, module by module where a number parts, so
that a wrong backend fails with the name of the check and the module rather than passing a smoke test.
"""
