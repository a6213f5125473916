"""One torch thread for the tests: results do not depend on it (every stage is row-wise and
each row is computed by one thread), and on a shared 2-core machine OpenMP's barriers make
two-thread runs up to 20x slower whenever another process holds a core."""

import torch

torch.set_num_threads(1)
