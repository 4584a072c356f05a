"""The policy the demo shows by default: doctor's advice, stated."""

import dataclasses

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.policies import hardware
from keras_dtype_policy.tools import state_memory


@dataclasses.dataclass(frozen=True)
class DemoChoice:
    """The demo's default policy and the policy `doctor` recommends.

    Attributes:
        policy: The mixed policy the demo trains under, next to float32.
        recommended: The policy `doctor` recommends for this machine.
        reason: Why `doctor` recommends it.
        low_precision: The advice for memory-bound training
            (`low_precision_advice`), or None where it does not fit.
    """

    policy: str
    recommended: str
    reason: str
    low_precision: str | None = None

    @property
    def follows_advice(self):
        """True where the demo's policy is the recommended one."""
        return self.policy == self.recommended


def demo_choice(devices, backend=None):
    """Returns the `DemoChoice` for these devices.

    The demo trains under the policy `doctor` recommends. Where that is
    float32, no mixed policy is faster here: the demo then shows the mixed
    policy this hardware computes best (`hardware.demo_policy`) next to
    float32, and says that float32 is the advice.

    Args:
        devices: The `Device`s of the backend, as `list_devices` gives them.
        backend: The backend name; defaults to the running one.
    """
    recommended, reason = hardware.recommend_policy(devices, backend)
    policy = recommended
    if recommended == "float32":
        policy = hardware.demo_policy(devices)
    return DemoChoice(
        policy, recommended, reason, low_precision_advice(devices)
    )


def low_precision_advice(devices):
    """Returns the advice for training that runs out of memory, or None.

    Training with bfloat16 weights and compensated updates fits where the
    devices Keras computes on all compute bfloat16 fast (a GPU of compute
    capability 8.0 or higher, a TPU, a CPU with AVX512_BF16, AMX or Arm's
    BF16): there it halves the weights and optimizer state of mixed
    precision without the lost updates of a plain "bfloat16" policy, and
    8-bit (4-bit) optimizer state brings Adam's 12 bytes a parameter down
    to about 4 (3).

    Args:
        devices: The `Device`s of the backend, as `list_devices` gives them.

    Returns:
        One sentence, or None where bfloat16 is not known to be fast.
    """
    targets = hardware.compute_devices(devices)
    if not targets or any(
        hardware.bfloat16_verdict(d).speed != hardware.FAST for d in targets
    ):
        return None
    eight_bit = state_memory.adam_bytes_per_parameter(
        "bfloat16", "stochastic_rounding", "8bit"
    )
    four_bit = state_memory.adam_bytes_per_parameter(
        "bfloat16", "stochastic_rounding", "4bit"
    )
    # On PyTorch the updates can run in the backward pass.
    release = ""
    if backend_dispatch.is_torch():
        release = (
            "; release_gradients=True frees each gradient as its update "
            "runs in the backward pass, 2 bytes a parameter fewer at the "
            "peak"
        )
    return (
        "if training runs out of memory, bfloat16 weights with "
        "compensated updates (the 'kahan_bfloat16' policy, or "
        "kdp.LowPrecisionOptimizer) keep weights and Adam's state in 8 "
        "bytes a parameter instead of mixed precision's 12, 6 with "
        "'stochastic_bfloat16', where a plain 'bfloat16' policy loses "
        "small updates; 8-bit optimizer state takes "
        f"{eight_bit:.2f} ('stochastic_bfloat16_8bit', or "
        f"state_dtype='8bit'), 4-bit state {four_bit:.2f} "
        f"('stochastic_bfloat16_4bit'){release} "
        "(docs/low-precision-training.md)"
    )
