import torch

import corelib


class ExampleSampler(corelib.Sampler):
    name = "example"

    def apply_temperature(self, x, s):
        """Step 10 in place: x float32 [B, V] divided by the row's temperature (greedy rows by 1)."""
        t = torch.where(s.greedy, torch.ones_like(s.temperature), s.temperature)
        return x.div_(t[:, None])
