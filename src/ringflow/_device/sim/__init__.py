"""The simulated GPU: virtual time, measured profiles, and a happens-before hazard checker."""

from .device import SimDevice
from .hazard import Access, AccessKind, HappensBeforeChecker
from .pool import charge
from ..hardware import PROFILES, HardwareProfile, get_profile

__all__ = ["SimDevice", "HardwareProfile", "PROFILES", "get_profile", "charge", "HappensBeforeChecker", "Access",
           "AccessKind"]
