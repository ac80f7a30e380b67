"""step_ab's A and B for QK-norm's backward: A keeps qkv, B recovers the normed heads from q and k."""
import cflib.model.fast as fast


def qkv_kept() -> None:
    fast.FusedAttention.normed_from_output = False


def from_output() -> None:
    fast.FusedAttention.normed_from_output = True
