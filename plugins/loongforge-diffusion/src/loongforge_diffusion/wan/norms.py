"""LayerNorm computed in float32 whatever the parameter and input dtypes.

Wan's reference keeps its LayerNorms in float32 so that bf16 training sees the same normalisation; a plain
``nn.LayerNorm`` would also refuse float32 input once ``model.to(bfloat16)`` has cast its affine weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FloatLayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).type_as(x)
