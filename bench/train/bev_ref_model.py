"""The PyTorch reference BEV model (torch_bev_ref.py): Parallax's C++ PerceptionModel written again in
plain torch.nn, with the same layers, parameter names and shapes (a C++ state dict loads with
strict=True) and the same forward computation: the ViT backbone (models/layers.h, vit.h,
backbone.h), the camera-geometry view transformer (models/view_transformer.cpp), the BEV encoder
and the heads (models/perception_model.cpp)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bev_ref_geometry import project_points, visibility_mask
from bev_ref_spec import BOX_CODE_SIZE

# ---- layers (models/layers.h, vit.h, backbone.h) ------------------------------------------------------


def norm_groups(channels):
    for g in (32, 16, 8, 4, 2):
        if channels % g == 0 and channels // g >= 4:
            return g
    return 1


class DenseLinear(nn.Linear):
    """y = x W^T + b (at::linear), weight N(0, 0.02), bias 0. An nn.Linear (DTensor's Colwise and
    Rowwise styles take only those) without nn.Linear's own initialisation."""

    def __init__(self, i, o, bias=True):
        nn.Module.__init__(self)
        self.in_features, self.out_features = i, o
        self.weight = nn.Parameter(torch.randn(o, i) * 0.02)
        if bias:
            self.bias = nn.Parameter(torch.zeros(o))
        else:
            self.register_parameter("bias", None)


class Attention(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.head_dim, self.dropout = v.dim // v.heads, v.dropout
        self.qkv = DenseLinear(v.dim, 3 * v.dim, v.qkv_bias)
        self.proj = DenseLinear(v.dim, v.dim)

    def forward(self, x):
        b, t = x.shape[0], x.shape[1]
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, t, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, heads * self.head_dim)
        return F.dropout(self.proj(o), self.dropout, self.training) if self.dropout > 0 else self.proj(o)


class MlpBlock(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.dropout = v.dropout
        self.fc1 = DenseLinear(v.dim, v.mlp_hidden)
        self.fc2 = DenseLinear(v.mlp_hidden, v.dim)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if self.dropout > 0:
            h = F.dropout(h, self.dropout, self.training)
            return F.dropout(self.fc2(h), self.dropout, self.training)
        return self.fc2(h)


class TransformerBlock(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.norm1 = nn.LayerNorm(v.dim, eps=1e-6)
        self.attn = Attention(v)
        self.norm2 = nn.LayerNorm(v.dim, eps=1e-6)
        self.mlp = MlpBlock(v)

    def forward(self, x):
        y = x + self.attn(self.norm1(x))
        return y + self.mlp(self.norm2(y))


class VisionTransformer(nn.Module):
    """Patch embedding + learned position embedding + pre-norm blocks + final LayerNorm, no class token."""

    def __init__(self, v, image_h, image_w):
        super().__init__()
        self.grid_h, self.grid_w = image_h // v.patch, image_w // v.patch
        self.patch_embed = nn.Conv2d(3, v.dim, v.patch, stride=v.patch)
        self.pos_embed = nn.Parameter(torch.randn(1, self.grid_h * self.grid_w, v.dim) * 0.02)
        self.block_names = [f"block{i}" for i in range(v.depth)]
        for name in self.block_names:
            self.add_module(name, TransformerBlock(v))
        self.norm = nn.LayerNorm(v.dim, eps=1e-6)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2).contiguous()
        x = x + self.pos_embed
        for name in self.block_names:
            x = getattr(self, name)(x)
        return self.norm(x)


class ImageEncoder(nn.Module):
    """ViT + neck (Linear to the BEV channels); returns [B*N, C, h, w] as a channels-last view of the tokens."""

    def __init__(self, spec):
        super().__init__()
        self.vit = VisionTransformer(spec.vit, spec.scene.image_height, spec.scene.image_width)
        self.neck = DenseLinear(spec.vit.dim, spec.bev_channels)

    def forward(self, images):
        tokens = self.neck(self.vit(images))
        return tokens.view(tokens.shape[0], self.vit.grid_h, self.vit.grid_w, tokens.shape[2]).permute(0, 3, 1, 2)


class ConvNormAct(nn.Module):
    """Conv2d (no bias, padding k/2) -> GroupNorm -> [ReLU]."""

    def __init__(self, i, o, k=3, stride=1, act=True):
        super().__init__()
        self.act = act
        self.conv = nn.Conv2d(i, o, k, stride=stride, padding=k // 2, bias=False)
        self.norm = nn.GroupNorm(norm_groups(o), o)

    def forward(self, x):
        y = self.norm(self.conv(x))
        return y.relu_() if self.act else y


class ResidualConvBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = ConvNormAct(c, c)
        self.conv2 = ConvNormAct(c, c, act=False)

    def forward(self, x):
        return (self.conv2(self.conv1(x)) + x).relu_()


class BevHeads(nn.Module):
    def __init__(self, c, hc, seg_classes, box_classes):
        super().__init__()
        self.seg_conv = ConvNormAct(c, hc)
        self.seg_out = nn.Conv2d(hc, seg_classes, 1)
        self.heat_conv = ConvNormAct(c, hc)
        self.heat_out = nn.Conv2d(hc, box_classes, 1)
        self.reg_conv = ConvNormAct(c, hc)
        self.reg_out = nn.Conv2d(hc, BOX_CODE_SIZE, 1)
        with torch.no_grad():
            self.heat_out.bias.fill_(-math.log((1 - 0.1) / 0.1))  # prior probability 0.1 (CenterNet)

    def forward(self, bev):
        return (self.seg_out(self.seg_conv(bev)), self.heat_out(self.heat_conv(bev)),
                self.reg_out(self.reg_conv(bev)))


# ---- view transformer (models/view_transformer.cpp) ---------------------------------------------------


class ViewTransformer(nn.Module):
    def __init__(self, spec):
        super().__init__()
        c, z, g = spec.bev_channels, len(spec.heights), spec.query
        self.grid, self.heights = g, spec.heights
        self.image_h, self.image_w = spec.scene.image_height, spec.scene.image_width
        self.lift1 = nn.Conv2d(z * c + z, c, 1)
        self.norm = nn.GroupNorm(norm_groups(c), c)
        self.lift2 = nn.Conv2d(c, c, 1)
        self.query_embed = nn.Parameter(torch.randn(1, c, g.nx, g.ny) * 0.02)

    def reference_points(self, device):
        g = self.grid
        x = g.x_min + (torch.arange(g.nx, dtype=torch.float32, device=device) + 0.5) * g.resolution
        y = g.y_min + (torch.arange(g.ny, dtype=torch.float32, device=device) + 0.5) * g.resolution
        z = torch.tensor(self.heights, dtype=torch.float32, device=device)
        mz, mx, my = torch.meshgrid(z, x, y, indexing="ij")
        return torch.stack([mx, my, mz], -1).reshape(-1, 3)  # [Z * Q, 3], height-major

    # Runs eagerly under `--mode compile`: its compacted sizes come from one host sync per forward
    # (data-dependent; as in the C++ model), which would make dynamo recompile for every batch.
    @torch.compiler.disable
    def sample(self, features, intrinsics, cam_to_ego):
        b, n = intrinsics.shape[0], intrinsics.shape[1]
        z, q = len(self.heights), self.grid.nx * self.grid.ny
        c = features.shape[1]
        uv, depth = project_points(self.reference_points(features.device), intrinsics, cam_to_ego)
        visible = visibility_mask(uv, depth, self.image_h, self.image_w)  # [B, N, P]
        grid = torch.stack([uv[..., 0] * (2.0 / self.image_w) - 1, uv[..., 1] * (2.0 / self.image_h) - 1], -1)
        per_cam = features.float().view(b, n, c, features.shape[2], features.shape[3])
        # Per camera only the points it sees: visible points moved to the front by a stable sort,
        # the first M = max visible count sampled, rows past a sample's count parked outside and
        # weighted 0; one host sync reads the M of every camera.
        max_count = visible.sum(2).max(0).values.tolist()
        samples, indices = [], []
        for cam in range(n):
            m = max_count[cam]
            if m == 0:
                continue
            vis = visible[:, cam]
            idx = torch.sort((~vis).to(torch.uint8), dim=1, stable=True).indices[:, :m]
            keep = vis.gather(1, idx)
            g = grid[:, cam].gather(1, idx.unsqueeze(-1).expand(b, m, 2))
            g = torch.where(keep.unsqueeze(-1), g, torch.full((), -2.0, dtype=g.dtype, device=g.device))
            s = torch.grid_sampler(per_cam[:, cam], g.unsqueeze(1), 0, 0, False).squeeze(2)  # [B, C, M]
            samples.append(s * keep.to(s.dtype).unsqueeze(1))
            indices.append(idx)
        p = z * q
        acc = torch.zeros(b, c, p, dtype=per_cam.dtype, device=per_cam.device)
        if samples:
            idx = torch.cat(indices, 1)
            acc = acc.scatter_add(2, idx.unsqueeze(1).expand(b, c, idx.shape[1]), torch.cat(samples, 2))
        count = visible.float().sum(1).view(b, z, q)
        return (acc / count.clamp_min(1).view(b, 1, p)).to(features.dtype).view(b, c, z, q), count

    def forward(self, features, intrinsics, cam_to_ego):
        feats, count = self.sample(features, intrinsics, cam_to_ego)
        b, nx, ny = feats.shape[0], self.grid.nx, self.grid.ny
        seen = (count > 0).to(feats.dtype).view(b, -1, nx, ny)
        x = torch.cat([feats.view(b, feats.shape[1] * feats.shape[2], nx, ny), seen], 1)
        x = self.lift2(self.norm(self.lift1(x)).relu_())
        return x + self.query_embed


# ---- the model (models/perception_model.cpp) -----------------------------------------------------------

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def normalize_images(images, dtype):
    if images.dtype != torch.uint8:
        return images.to(dtype)
    x = images.float()
    for c in range(3):
        x.select(1, c).mul_(1.0 / (255.0 * IMAGENET_STD[c])).sub_(IMAGENET_MEAN[c] / IMAGENET_STD[c])
    return x.to(dtype)


class PerceptionModel(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        c = spec.bev_channels
        self.encoder = ImageEncoder(spec)
        self.view = ViewTransformer(spec)
        self.block_names = [f"bev_block{i}" for i in range(spec.encoder_blocks)]
        for name in self.block_names:
            self.add_module(name, ResidualConvBlock(c))
        self.heads = BevHeads(c, spec.head_channels, len(spec.scene.bev_classes), len(spec.scene.box_classes))

    def forward(self, batch):
        im = batch["images"]
        b, n = im.shape[0], im.shape[1]
        # [B, N, H, W, 3] -> NCHW in channels-last layout: no copy.
        x = im.reshape(b * n, im.shape[2], im.shape[3], 3).permute(0, 3, 1, 2)
        x = normalize_images(x, self.view.lift1.weight.dtype)
        bev = self.view(self.encoder(x), batch["intrinsics"], batch["cam_to_ego"])
        for name in self.block_names:
            bev = getattr(self, name)(bev)
        seg, heat, reg = self.heads(bev)
        lg = self.spec.label_grid()
        if seg.shape[2] != lg.nx or seg.shape[3] != lg.ny:
            seg = F.interpolate(seg, size=(lg.nx, lg.ny), mode="bilinear", align_corners=False)
        return {"bev_logits": seg, "heatmap": heat, "box_reg": reg}


def group_parameter_counts(model):
    """Parameters per component, grouped like PerceptionModel::cost_breakdown()."""
    groups = {"backbone": 0, "view_transformer": 0, "bev_encoder": 0, "heads": 0}
    prefix = {"encoder": "backbone", "view": "view_transformer", "heads": "heads"}
    for name, p in model.named_parameters():
        top = name.split(".")[0]
        groups["bev_encoder" if top.startswith("bev_block") else prefix[top]] += p.numel()
    return groups
