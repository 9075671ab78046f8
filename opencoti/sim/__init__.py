"""A deterministic simulator of the engine's decode speed, for admission control.

``profile``: step-cost profiles (measured or synthetic) and their fitting; ``engine``: a
simulated engine core that runs the real ``Metrics`` and ``AdmissionController`` on a simulated
clock; ``ramp``: the spawn-ramp scenario and the metrics users feel (share of session-decode
seconds under the floor, deep under it, overshoot, wall time, throughput); ``bounds``: the least
expected wall time of any schedule with at most k sessions in flight (what a target on the wall
time can ask for at all).
"""

from .profile import StepClock, StepProfile, fit_profile, profile_names

__all__ = ["StepClock", "StepProfile", "fit_profile", "profile_names"]
