"""Dynamic loss scaling for fp16: back off on overflow, grow after a window of good steps."""


class DynamicLossScaler:
    """Multiply the loss by ``scale`` before the backward; divide the gradients by it in the step.

    An overflow anywhere (the caller has already agreed on it over all ranks) halves the
    scale and the step is skipped; ``window`` consecutive good steps double it.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, window: int = 1000, min_scale: float = 1.0,
                 enabled: bool = True):
        self.enabled = enabled                         # False in fp32 mode: the scale stays 1
        self.scale = float(init_scale) if enabled else 1.0
        self.window = window                           # good steps before growing
        self.min_scale = min_scale
        self.good_steps = 0                            # consecutive steps without overflow

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.min_scale, self.scale / 2.0)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.scale *= 2.0
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
