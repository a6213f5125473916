import torch

import corelib


class ExampleSampler(corelib.Sampler):
    name = "example"

    def apply_temperature(self, x, s):
        """Step 10 in place: x float32 [B, V] divided by the row's temperature (greedy rows by
        1); a batch with a dynamic temperature takes the reference's step (not in place)."""
        if s.any_dynatemp:
            return super().apply_temperature(x, s)
        t = torch.where(s.greedy, torch.ones_like(s.temperature), s.temperature)
        return x.div_(t[:, None])
