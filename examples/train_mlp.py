"""Train an MLP with GPipe: two partitions, four micro-batches, CPU by default.

Run it with ``python examples/train_mlp.py``. For GPUs, pass ``devices=["cuda:0",
"cuda:1"]`` (or leave ``devices`` out to use every GPU) and move the inputs to the
first device and the targets to the last.
"""

import torch
from torch import nn

from torchgpipe import GPipe

torch.manual_seed(0)
torch.set_num_threads(1)  # each CPU partition runs on a worker thread of its own

model = nn.Sequential(
    nn.Linear(64, 256),
    nn.ReLU(),
    nn.Linear(256, 256),
    nn.ReLU(),
    nn.Linear(256, 256),
    nn.ReLU(),
    nn.Linear(256, 1),
)
# Layers 0-3 on the first partition, 4-6 on the second; each batch in 4 micro-batches.
model = GPipe(model, balance=[4, 3], devices=["cpu", "cpu"], chunks=4)

x = torch.randn(512, 64)
y = x[:, :8].sum(dim=1, keepdim=True)  # a target the MLP can learn in a few steps

optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(1, 31):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)  # the output is on the last device
    loss.backward()
    optimizer.step()
    if step % 5 == 0:
        print(f"step {step:2d}  loss {loss.item():.4f}")
