"""The text of a Dash component tree, for the dashboard tests that read a callback's output."""

from __future__ import annotations

import numpy as np


def dash_text(component) -> str:
    """All the text in a Dash component tree."""
    if component is None:
        return ""
    if isinstance(component, (str, int, float, np.generic)):
        return str(component)
    if isinstance(component, (list, tuple)):
        return " ".join(dash_text(c) for c in component)
    return dash_text(getattr(component, "children", None))
