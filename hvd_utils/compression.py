"""What gradients travel as: float32 as computed, fp16 (Horovod's own compressor) or bfloat16.

bfloat16 keeps float32's 8 exponent bits and drops mantissa bits: half the bytes of float32, like fp16, but a
gradient beyond fp16's 65504 stays finite instead of becoming inf. Horovod 0.28.1 has no bfloat16 type in its
core; scripts/horovod/patches/0022-bfloat16.patch adds it to MPI, Gloo and NCCL, summing in float32 and rounding
each result once, so the only precision lost is bfloat16's rounding of what is sent and of the sum.
"""
import horovod.torch as hvd
import torch


class BF16Compressor(hvd.compression.Compressor):
    """Floating-point tensors travel as bfloat16 and come back in their own type; others travel as they are."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.bfloat16:
            return tensor.to(torch.bfloat16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


def wire_format(fp16=False, bf16=False):
    """The Horovod compression for the gradients: fp16, bf16 or none (the config refuses both at once)."""
    if bf16:
        return BF16Compressor
    return hvd.Compression.fp16 if fp16 else hvd.Compression.none
