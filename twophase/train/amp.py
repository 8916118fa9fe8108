"""Moved to `twophase.system.precision`; this old name re-exports what other modules import from it until their
imports move."""
from ..system.precision import (  # noqa: F401
    autocast, check_device, counts_as_bad, grad_scaler, scale_coefficients, unscale, update,
)
