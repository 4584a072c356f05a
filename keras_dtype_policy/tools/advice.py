"""The policy the demo shows by default: doctor's advice, stated."""

import dataclasses

from keras_dtype_policy.policies import hardware


@dataclasses.dataclass(frozen=True)
class DemoChoice:
    """The demo's default policy and the policy `doctor` recommends.

    Attributes:
        policy: The mixed policy the demo trains under, next to float32.
        recommended: The policy `doctor` recommends for this machine.
        reason: Why `doctor` recommends it.
    """

    policy: str
    recommended: str
    reason: str

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
    return DemoChoice(policy, recommended, reason)
