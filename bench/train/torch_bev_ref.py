#!/usr/bin/env python3
"""PyTorch reference for workload W2: the `bev` perception model (`model.name: bev`, default size
`base`: 6 cameras, ViT-B/16 backbone, camera-geometry view transformer, residual conv BEV encoder,
segmentation + CenterPoint heads), bf16 autocast, fused AdamW, synthetic in-memory batches (no
loader), on one GPU or under `torchrun --nproc-per-node N` (DDP). Prints one JSON line per run
(rank 0).

The model is Parallax's C++ PerceptionModel (models/perception_model.cpp and the files it uses)
written again in plain torch.nn: the same layers, parameter names and shapes (a C++ state dict
loads with strict=True), the same forward computation (uint8 normalisation, ViT with fused qkv and
SDPA, per-camera compacted grid_sample of the projected pillar reference points in float32,
scatter-add mean over cameras, seen flags, 1x1-conv lift, query embedding, BEV blocks, heads,
bilinear resampling to the label grid) and the same losses (class-balanced cross-entropy,
CenterNet focal loss, box L1 at the centre cells). Checked on CPU in float32 against the C++ model
with its own parameters and example batch (bev/tiny and bev/base at both scenes): identical outputs,
loss terms and gradients (2026-11-22; the C++ patch embedding has since become a GEMM on the patch
rows, the same sums in another order, so they now agree to float32 rounding, not bitwise). Only the ViT backbone is mirrored (W2 uses it), not `model.backbone: conv`.
Under bf16 autocast the ViT residual stream is float32, as eager PyTorch does it. `--mode compile`
compiles the model except the view transformer's sampling step, whose sizes come from a host sync
(as in the C++ model) and would make dynamo recompile for every batch.

A sample is one scene: 6 camera images plus its camera geometry and targets; img_per_s counts
scenes. FLOPs: the forward FLOPs per sample are computed with the same analytic formula as the C++
model's forward_flops_per_sample() (models/layers.h cost convention: matmuls, convolutions and
attention QK^T/AV at 2 FLOPs per multiply-add; training = 3x forward), unless
--fwd-gflops-per-sample gives a number (e.g. the one `parallax train` logs); the JSON says which.

Scenes: `--scene benchmark` (default) is models::benchmark_scene(size), the scene `parallax train`
builds the model for with synthetic batches (small..3b: 6 x 256x704 images, 200 x 200 BEV at 0.5 m
over [-50, 50]^2; tiny: the defaults); `--scene default` is core::SceneSpec's defaults (6 x 128x224
images, 100 x 100 BEV labels at 0.5 m over [-25, 25]^2), the scene of `parallax datagen`'s defaults. bench/train/run_w2.sh picks the one whose parameter
count matches what `parallax train` logged.

  python3 bench/train/torch_bev_ref.py --batch 32 --mode eager
  python3 bench/train/torch_bev_ref.py --batch 32 --mode compile
  torchrun --nproc-per-node 2 bench/train/torch_bev_ref.py --batch 32 --mode eager
  torchrun --nproc-per-node 2 bench/train/torch_bev_ref.py --size large --batch 8 --tp 2 [--sp]
  python3 bench/train/torch_bev_ref.py --device cpu --size tiny --batch 2 --warmup 1 --iters 3
  python3 bench/train/torch_bev_ref.py --size base --params-only   # parameters / FLOPs per module

Tensor parallelism (`--tp N`, `--sp`; issue 24 row 3): PyTorch DTensor TP as its documentation
and torchtitan apply it (`parallelize_module` over a 1-D device mesh of the N ranks; every rank
sees the same batch): in every ViT block `qkv` and `fc1` ColwiseParallel, `proj` and `fc2`
RowwiseParallel; with `--sp` also the LayerNorms SequenceParallel (tokens sharded along dim 1
between the blocks), each sub-block's input gathered by PrepareModuleInput, the row layers'
outputs reduce-scattered to Shard(1), the first block's input sharded and the final norm's output
gathered before the neck. The layers Parallax keeps replicated (patch embedding, neck, view
transformer, BEV encoder, heads) stay replicated here too. The fused qkv weight's rows are
reordered once at setup into [q, k, v] blocks per rank, so DTensor's contiguous Colwise shard gives
each rank whole heads (Parallax's per-part split, Megatron's `stride`): the reordered model
computes the same function as the dense one. `--check` prints the first two losses (the second
after one SGD step at lr 1e-3 instead of AdamW, so it checks the gradients too); on CPU in float32, bev/small, one scene,
`--tp 2` and `--tp 2 --sp` give the one-process losses within 1e-6 relative (2026-11-28):
  python3 bench/train/torch_bev_ref.py --device cpu --size small --scene default --batch 1 \
      --warmup 0 --iters 2 --window 1 --check
  torchrun --nproc-per-node 2 bench/train/torch_bev_ref.py <the same> --tp 2 [--sp]
DTensor shards the tokens evenly only when tp divides them (the benchmark scene's 16 x 44 = 704
tokens: tp 2 and 4); an uneven split failed on gloo here.
"""
import argparse
import json
import math
import resource
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from step_timing import init_process, median_step_ms, to_float8, wrap_ddp  # same folder: python puts the script's folder on sys.path

PEAK_BF16 = 989e12  # H100/H200 dense bf16, as Parallax's trainer (train/trainer.cpp)
BOX_CODE_SIZE = 8
MIN_DEPTH = 0.1

# ---- configuration (models/perception_model.cpp size_preset, core/scene.h, benchmark_scene) ---------


@dataclass
class VitSpec:
    dim: int
    depth: int
    heads: int
    mlp_hidden: int
    patch: int
    qkv_bias: bool = True
    dropout: float = 0.0


# size -> (ViT dim, depth, heads, mlp, patch), query resolution (m), heights, BEV C, head C, BEV blocks
SIZE_PRESETS = {
    "tiny": (VitSpec(96, 2, 3, 384, 8), 1.0, 4, 64, 32, 2),
    "small": (VitSpec(384, 12, 6, 1536, 16), 0.5, 4, 128, 64, 2),
    "base": (VitSpec(768, 12, 12, 3072, 16), 0.5, 4, 256, 128, 3),
    "large": (VitSpec(1024, 24, 16, 4096, 16), 0.5, 8, 256, 128, 4),
    "3b": (VitSpec(2560, 36, 32, 10240, 16), 0.5, 8, 384, 192, 4),
}


@dataclass
class Scene:  # core::SceneSpec
    num_cameras: int = 6
    image_height: int = 128
    image_width: int = 224
    x_min: float = -25.0
    x_max: float = 25.0
    y_min: float = -25.0
    y_max: float = 25.0
    bev_resolution: float = 0.5
    bev_classes: list = field(default_factory=lambda: ["background", "road", "marking", "vehicle", "pedestrian",
                                                       "cyclist"])
    box_classes: list = field(default_factory=lambda: ["vehicle", "pedestrian", "cyclist"])
    max_boxes: int = 64

    def bev_x_cells(self):
        return int((self.x_max - self.x_min) / self.bev_resolution + 0.5)

    def bev_y_cells(self):
        return int((self.y_max - self.y_min) / self.bev_resolution + 0.5)


@dataclass
class BevGrid:  # models/bev_grid.h
    x_min: float
    y_min: float
    resolution: float
    nx: int
    ny: int


def make_scene(size, which):
    s = Scene()
    if which == "default" or size == "tiny":
        return s
    s.image_height, s.image_width = 256, 704
    s.x_min = s.y_min = -50.0
    s.x_max = s.y_max = 50.0
    s.bev_resolution = 0.5
    return s


def llround(x):  # std::llround for the positive values used here
    return int(math.floor(x + 0.5))


@dataclass
class BevSpec:  # models::BevModelSpec (backbone vit)
    size: str
    vit: VitSpec
    scene: Scene
    query: BevGrid
    heights: list
    bev_channels: int
    head_channels: int
    encoder_blocks: int
    seg_loss_weight: float = 1.0
    heatmap_loss_weight: float = 1.0
    box_loss_weight: float = 0.25

    def label_grid(self):
        sc = self.scene
        return BevGrid(sc.x_min, sc.y_min, sc.bev_resolution, sc.bev_x_cells(), sc.bev_y_cells())


def make_bev_spec(size, scene):
    vit, res, z, bev_c, head_c, blocks = SIZE_PRESETS[size]
    if scene.image_height % vit.patch or scene.image_width % vit.patch:
        raise ValueError(f"image size {scene.image_height}x{scene.image_width} not divisible by patch {vit.patch}")
    ex, ey = scene.x_max - scene.x_min, scene.y_max - scene.y_min
    nx = max(1, llround(ex / res))
    cell = ex / nx
    query = BevGrid(scene.x_min, scene.y_min, cell, nx, max(1, llround(ey / cell)))
    heights = [1.0] if z == 1 else [2.0 * k / (z - 1) for k in range(z)]
    return BevSpec(size, vit, scene, query, heights, bev_c, head_c, blocks)


# ---- analytic cost (models/layers.cpp, vit.cpp, backbone.cpp, view_transformer.cpp, perception_model.cpp) -


def linear_cost(i, o, bias, rows):
    return i * o + (o if bias else 0), 2.0 * rows * i * o


def conv_cost(i, o, k, bias, oh, ow):
    w = i * o * k * k
    return w + (o if bias else 0), 2.0 * oh * ow * w


def add(*costs):
    return sum(c[0] for c in costs), sum(c[1] for c in costs)


def analytic_cost(spec):
    """[(name, params, forward FLOPs per sample)] exactly as PerceptionModel::analytic_cost."""
    v, sc, g = spec.vit, spec.scene, spec.query
    gh, gw = sc.image_height // v.patch, sc.image_width // v.patch
    t = gh * gw
    block = add((4 * v.dim, 0.0), linear_cost(v.dim, 3 * v.dim, v.qkv_bias, t), linear_cost(v.dim, v.dim, True, t),
                linear_cost(v.dim, v.mlp_hidden, True, t), linear_cost(v.mlp_hidden, v.dim, True, t),
                (0, 2.0 * 2.0 * t * t * v.dim))
    vit = add(conv_cost(3, v.dim, v.patch, True, gh, gw), (t * v.dim, 0.0), (block[0] * v.depth, block[1] * v.depth),
              (2 * v.dim, 0.0))
    backbone = add(vit, linear_cost(v.dim, spec.bev_channels, True, t))
    backbone = (backbone[0], backbone[1] * sc.num_cameras)
    c, z = spec.bev_channels, len(spec.heights)
    view = add(conv_cost(z * c + z, c, 1, True, g.nx, g.ny), (2 * c, 0.0), conv_cost(c, c, 1, True, g.nx, g.ny),
               (c * g.nx * g.ny, 0.0))
    cna = add(conv_cost(c, c, 3, False, g.nx, g.ny), (2 * c, 0.0))
    enc = (2 * cna[0] * spec.encoder_blocks, 2 * cna[1] * spec.encoder_blocks)
    hc = spec.head_channels
    branch = add(conv_cost(c, hc, 3, False, g.nx, g.ny), (2 * hc, 0.0))
    heads = add((3 * branch[0], 3 * branch[1]), conv_cost(hc, len(sc.bev_classes), 1, True, g.nx, g.ny),
                conv_cost(hc, len(sc.box_classes), 1, True, g.nx, g.ny),
                conv_cost(hc, BOX_CODE_SIZE, 1, True, g.nx, g.ny))
    return [("backbone",) + backbone, ("view_transformer",) + view, ("bev_encoder",) + enc, ("heads",) + heads]


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


# ---- geometry (models/geometry.cpp): float32 elementwise ops, immune to autocast ----------------------


def small_matmul(a, b):
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


def invert_rigid(t):
    t = t.float()
    rt = t[..., :3, :3].transpose(-1, -2)
    top = torch.cat([rt, -small_matmul(rt, t[..., :3, 3:4])], -1)
    bottom = torch.zeros_like(t[..., 3:4, :])
    bottom[..., 3] = 1
    return torch.cat([top, bottom], -2)


def project_points(points, intrinsics, cam_to_ego):
    """Ego points [P, 3] or [B, P, 3] -> (uv [B, N, P, 2], depth [B, N, P])."""
    m = small_matmul(intrinsics.float(), invert_rigid(cam_to_ego)[..., :3, :])  # [B, N, 3, 4]
    p = points.float()
    if p.dim() == 2:
        p = p.unsqueeze(0)
    uvw = (m[..., :3].unsqueeze(2) * p.unsqueeze(1).unsqueeze(-2)).sum(-1) + m[..., 3].unsqueeze(2)
    depth = uvw[..., 2]
    safe = torch.where(depth.abs() < 1e-6, torch.full_like(depth, 1e-6), depth)
    return uvw[..., :2] / safe.unsqueeze(-1), depth


def visibility_mask(uv, depth, h, w):
    u, v = uv[..., 0], uv[..., 1]
    return (depth > MIN_DEPTH) & (u >= 0) & (u < w) & (v >= 0) & (v < h)


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


# ---- losses (models/perception_model.cpp loss(), models/detection.cpp) ---------------------------------


def encode_detection_targets(boxes, g, num_classes):
    bx = boxes.float()
    b, k = bx.shape[0], bx.shape[1]
    col = lambda c: bx[..., c]  # noqa: E731
    gx, gy = (col(0) - g.x_min) / g.resolution, (col(1) - g.y_min) / g.resolution
    ci, cj = gx.floor(), gy.floor()
    cls = col(7)
    mask = (cls >= 0) & (cls < num_classes) & (col(8) > 0) & (ci >= 0) & (ci < g.nx) & (cj >= 0) & (cj < g.ny)
    index = torch.where(mask, ci * g.ny + cj, torch.zeros_like(ci)).long()
    safe_log = lambda v: v.clamp_min(1e-3).log()  # noqa: E731
    codes = torch.stack([gx - ci, gy - cj, col(2), safe_log(col(3)), safe_log(col(4)), safe_log(col(5)),
                         col(6).sin(), col(6).cos()], -1)
    heatmap = torch.zeros(b, num_classes, g.nx, g.ny, dtype=bx.dtype, device=bx.device)
    if k > 0:
        diag = (col(3).pow(2) + col(4).pow(2)).sqrt()
        sigma = (diag / (6.0 * g.resolution)).clamp_min(0.8)
        ii = torch.arange(g.nx, dtype=bx.dtype, device=bx.device).view(1, 1, -1, 1)
        jj = torch.arange(g.ny, dtype=bx.dtype, device=bx.device).view(1, 1, 1, -1)
        e = lambda t: t.unsqueeze(-1).unsqueeze(-1)  # noqa: E731
        d2 = (ii - e(ci)).pow(2) + (jj - e(cj)).pow(2)
        gauss = torch.exp(-d2 / (2 * e(sigma).pow(2))) * e(mask.float())
        heatmap = torch.stack([(gauss * e((cls == c).float())).amax(1) for c in range(num_classes)], 1)
    return heatmap, codes, index, mask


def heatmap_focal_loss(logits, target):
    x, t = logits.float(), target.float()
    pos = t.eq(1).float()
    p = torch.sigmoid(x)
    pos_term = (1 - p).pow(2) * F.logsigmoid(x) * pos
    neg_term = (1 - t).pow(4) * p.pow(2) * F.logsigmoid(-x) * (1 - pos)
    return -(pos_term.sum() + neg_term.sum()) / pos.sum().clamp_min(1)


def box_regression_loss(box_reg, codes, index, mask):
    b, k = box_reg.shape[0], index.shape[1]
    pred = box_reg.reshape(b, BOX_CODE_SIZE, -1).gather(2, index.unsqueeze(1).expand(b, BOX_CODE_SIZE, k))
    pred = pred.transpose(1, 2).float()
    m = mask.float()
    return ((pred - codes).abs().sum(-1) * m).sum() / m.sum().clamp_min(1)


def bev_loss(spec, batch, pred):
    """(total, {"seg_ce", "heatmap_focal", "box_l1"}) as PerceptionModel::loss."""
    logits = pred["bev_logits"].float()
    ns = logits.shape[1]
    labels = batch["bev_semantics"].long()
    valid = (labels >= 0) & (labels < ns)
    counts = torch.zeros(ns, dtype=logits.dtype, device=logits.device).index_add_(
        0, torch.where(valid, labels, torch.zeros_like(labels)).flatten(), valid.flatten().float())
    weight = (counts / counts.sum().clamp_min(1)).clamp_min(1e-3).rsqrt()
    seg = F.cross_entropy(logits, torch.where(valid, labels, torch.full_like(labels, -100)), weight=weight,
                          ignore_index=-100)
    heat_t, codes, index, mask = encode_detection_targets(batch["boxes"].to(logits.device), spec.query,
                                                          len(spec.scene.box_classes))
    heat = heatmap_focal_loss(pred["heatmap"], heat_t)
    reg = box_regression_loss(pred["box_reg"], codes, index, mask)
    total = spec.seg_loss_weight * seg + spec.heatmap_loss_weight * heat + spec.box_loss_weight * reg
    return total, {"seg_ce": seg.detach(), "heatmap_focal": heat.detach(), "box_l1": reg.detach()}


# ---- synthetic batches (PerceptionModel::example_batch, models/camera_rig.cpp) -------------------------


def _rot_z(a):
    c, s = math.cos(a), math.sin(a)
    return torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)


def _cam_pitch(p):
    c, s = math.cos(p), math.sin(p)
    return torch.tensor([[1.0, 0.0, 0.0], [0.0, c, s], [0.0, -s, c]], dtype=torch.float64)


def _cam_roll(r):
    c, s = math.cos(r), math.sin(r)
    return torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)


# Camera axes in the ego frame for a camera looking along ego +x: x right = -y, y down = -z, z forward = +x.
_CAM_TO_EGO_AXES = torch.tensor([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]], dtype=torch.float64)


def surround_rig(n, cams, h, w, hfov_deg=70.0, mount_height=1.6, mount_radius=1.0, max_angle_deg=2.0,
                 max_height_m=0.1, gen=None):
    """A jittered surround rig (make_surround_rig + jitter_rig): intrinsics [n, N, 3, 3], cam_to_ego [n, N, 4, 4]."""
    f = 0.5 * w / math.tan(0.5 * math.radians(hfov_deg))
    k = torch.tensor([[f, 0.0, 0.5 * w], [0.0, f, 0.5 * h], [0.0, 0.0, 1.0]], dtype=torch.float32)
    a = math.radians(max_angle_deg)
    u = torch.rand(n, cams, 4, dtype=torch.float64, generator=gen) * 2 - 1
    e = torch.zeros(n, cams, 4, 4, dtype=torch.float64)
    for c in range(cams):
        yaw = 2.0 * math.pi * c / cams
        base = _rot_z(yaw) @ _CAM_TO_EGO_AXES
        for s in range(n):
            us = u[s, c].tolist()
            e[s, c, :3, :3] = _rot_z(a * us[0]) @ base @ _cam_pitch(a * us[1]) @ _cam_roll(a * us[2])
            e[s, c, 0, 3] = mount_radius * math.cos(yaw)
            e[s, c, 1, 3] = mount_radius * math.sin(yaw)
            e[s, c, 2, 3] = mount_height + max_height_m * us[3]
            e[s, c, 3, 3] = 1.0
    return k.expand(n, cams, 3, 3).contiguous(), e.float()


def _typical_size(name):
    if name in ("vehicle", "car"):
        return (4.5, 1.9, 1.6)
    if name == "pedestrian":
        return (0.7, 0.7, 1.75)
    if name in ("cyclist", "bicycle"):
        return (1.8, 0.7, 1.6)
    return (2.0, 1.0, 1.5)


def example_batch(spec, n, gen=None):
    """A random batch with the keys, shapes and dtypes of PerceptionModel::example_batch(n): noise uint8
    images on a jittered 6-camera surround rig, 2-8 boxes per sample (class-typical sizes, visibility
    through the cameras) and BEV semantics consistent with them (a road band with markings, box
    footprints). CPU tensors."""
    sc = spec.scene
    cams, kmax, nbox = sc.num_cameras, sc.max_boxes, len(sc.box_classes)
    rand = lambda *shape: torch.rand(*shape, generator=gen)  # noqa: E731
    intrinsics, cam_to_ego = surround_rig(n, cams, sc.image_height, sc.image_width, gen=gen)
    images = torch.randint(0, 256, (n, cams, sc.image_height, sc.image_width, 3), dtype=torch.uint8, generator=gen)
    typical = torch.tensor([_typical_size(c) for c in sc.box_classes], dtype=torch.float32)
    hi = min(8, kmax)
    lo = min(2, hi)
    count = torch.randint(lo, hi + 1, (n,), generator=gen)
    row_valid = torch.arange(kmax).unsqueeze(0) < count.unsqueeze(1)
    cls = torch.randint(0, nbox, (n, kmax), generator=gen)
    dims = typical[cls.flatten()].view(n, kmax, 3) * (0.85 + 0.3 * rand(n, kmax, 3))
    uniform = lambda a, b: a + (b - a) * rand(n, kmax)  # noqa: E731
    x, y = uniform(sc.x_min + 2, sc.x_max - 2), uniform(sc.y_min + 2, sc.y_max - 2)
    near = (x.abs() < 4) & (y.abs() < 4)
    y = torch.where(near, (y + 8).clamp_max(sc.y_max - 2), y)
    yaw = uniform(-math.pi, math.pi)
    l, w, h = dims.unbind(-1)
    zc = h / 2
    signs = torch.tensor([[sx, sy, sz] for sz in (-0.5, 0.5) for sy in (-0.5, 0.5) for sx in (-0.5, 0.5)]
                         + [[0.0, 0.0, 0.0]])
    local = signs.view(1, 1, 9, 3) * dims.unsqueeze(2)
    c, s = yaw.cos().unsqueeze(-1), yaw.sin().unsqueeze(-1)
    lx, ly, lz = local.unbind(-1)
    pts = torch.stack([x.unsqueeze(-1) + c * lx - s * ly, y.unsqueeze(-1) + s * lx + c * ly, zc.unsqueeze(-1) + lz], -1)
    uv, depth = project_points(pts.view(n, kmax * 9, 3), intrinsics, cam_to_ego)
    seen = visibility_mask(uv, depth, sc.image_height, sc.image_width).any(1).view(n, kmax, 9)
    vis = seen.float().mean(-1)
    boxes = torch.stack([x, y, zc, l, w, h, yaw, cls.float(), vis], -1)
    pad = torch.zeros(9)
    pad[7] = -1
    boxes = torch.where(row_valid.unsqueeze(-1), boxes, pad)

    lg = spec.label_grid()
    cx = (lg.x_min + (torch.arange(lg.nx, dtype=torch.float32) + 0.5) * lg.resolution).view(1, -1, 1)
    cy = (lg.y_min + (torch.arange(lg.ny, dtype=torch.float32) + 0.5) * lg.resolution).view(1, 1, -1)
    sem = torch.zeros(n, lg.nx, lg.ny, dtype=torch.long)
    y0 = (rand(n) * 16 - 8).view(-1, 1, 1)
    names = sc.bev_classes
    if "road" in names:
        sem.masked_fill_(((cy - y0).abs() < 4).expand(n, lg.nx, lg.ny), names.index("road"))
    if "marking" in names:
        dash = torch.floor(cx / 3).remainder(2) == 0
        sem.masked_fill_(((cy - y0).abs() < 0.25) & dash, names.index("marking"))
    box_to_bev = torch.tensor([names.index(b) if b in names else -1 for b in sc.box_classes])
    for k in range(kmax):
        v = lambda t: t[:, k].reshape(-1, 1, 1)  # noqa: E731
        dx, dy = cx - v(x), cy - v(y)
        along = dx * v(yaw).cos() + dy * v(yaw).sin()
        across = -dx * v(yaw).sin() + dy * v(yaw).cos()
        bev_cls = box_to_bev[cls[:, k]].view(-1, 1, 1)
        inside = (along.abs() <= v(l) / 2) & (across.abs() <= v(w) / 2) & v(row_valid) & (bev_cls >= 0)
        sem = torch.where(inside, bev_cls, sem)
    return {"images": images, "intrinsics": intrinsics, "cam_to_ego": cam_to_ego, "bev_semantics": sem,
            "boxes": boxes, "scene_index": torch.arange(n)}


# ---- optimizer groups (optim/param_groups.cpp) ----------------------------------------------------------

NO_DECAY_NAMES = ("pos_embed", "cls_token", "dist_token", "bev_queries")


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.dim() <= 1 or any(s in name for s in NO_DECAY_NAMES)
        (no_decay if skip else decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]]


# ---- benchmark --------------------------------------------------------------------------------------------


def build(size, scene_name, seed=0):
    torch.manual_seed(seed)
    spec = make_bev_spec(size, make_scene(size, scene_name))
    return spec, PerceptionModel(spec)


def cost_report(spec, model):
    analytic = analytic_cost(spec)
    counted = group_parameter_counts(model)
    total_counted = sum(p.numel() for p in model.parameters())
    rows = {name: {"params": counted[name], "params_analytic": params, "fwd_gflops": round(flops / 1e9, 6)}
            for name, params, flops in analytic}
    sc = spec.scene
    return {"model": f"bev/{spec.size} (vit)",
            "scene": f"{sc.num_cameras} x {sc.image_height}x{sc.image_width}, BEV labels "
                     f"{sc.bev_x_cells()}x{sc.bev_y_cells()} @ {sc.bev_resolution} m, "
                     f"query {spec.query.nx}x{spec.query.ny}",
            "params": total_counted, "params_analytic": sum(r[1] for r in analytic),
            "fwd_gflops_per_sample": round(sum(r[2] for r in analytic) / 1e9, 6), "groups": rows}


def reorder_qkv_for_tp(model, tp):
    """Rows of every fused qkv [3 D, D] (and its bias) from [q; k; v] to [q_0 k_0 v_0; q_1 k_1 v_1; ...]
    (q_r: rank r's D/tp rows of q), so that a contiguous split into tp chunks gives each rank its own
    heads' q, k and v in the [3, H/tp, hd] order Attention.forward views them in."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Attention):
                d3 = m.qkv.weight.shape[0]
                d = d3 // 3
                if d % (tp * m.head_dim):
                    raise SystemExit(f"torch_bev_ref: {d // m.head_dim} heads are not divisible by tp {tp}")
                idx = torch.arange(d3).view(3, tp, d // tp).transpose(0, 1).reshape(-1)
                m.qkv.weight.copy_(m.qkv.weight[idx])
                if m.qkv.bias is not None:
                    m.qkv.bias.copy_(m.qkv.bias[idx])


def apply_dtensor_tp(model, mesh, sp):
    """DTensor tensor (and sequence) parallelism on the ViT blocks of `model` (see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    vit = model.encoder.vit
    for name in vit.block_names:
        block = getattr(vit, name)
        if sp:
            plan = {
                "norm1": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                "norm2": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.fc1": ColwiseParallel(),
                "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
            }
        else:
            plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                    "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
        parallelize_module(block, mesh, plan)
    if sp:
        # Into the sequence-parallel region before the first block, out of it after the final norm.
        parallelize_module(getattr(vit, vit.block_names[0]), mesh,
                           PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True))
        parallelize_module(vit.norm, mesh, SequenceParallel())
        parallelize_module(model.encoder.neck, mesh,
                           PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                              use_local_output=True))


def split_dtensor_groups(groups):
    """Each optimizer group split into its DTensor and plain-tensor parameters: the fused AdamW
    kernel takes one kind per call."""
    from torch.distributed.tensor import DTensor
    out = []
    for g in groups:
        for want in (True, False):
            ps = [p for p in g["params"] if isinstance(p, DTensor) == want]
            if ps:
                out.append({**g, "params": ps})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="samples (6-camera scenes) per GPU")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--float8", action="store_true",
                    help="torchao float8 training on the ViT blocks' linear layers (with --mode compile, as torchao advises)")
    ap.add_argument("--grad-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="DDP gradient all-reduce dtype (bf16: PyTorch's bf16_compress_hook)")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--window", type=int, default=10,
                    help="steps per timed window (no sync inside; Parallax's train.log_every)")
    ap.add_argument("--size", choices=list(SIZE_PRESETS), default="base")
    ap.add_argument("--scene", choices=["benchmark", "default"], default="benchmark",
                    help="benchmark: models::benchmark_scene(size), as `parallax train` with synthetic "
                         "batches; default: core::SceneSpec's defaults")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: bf16 autocast; cpu: float32 (smoke tests)")
    ap.add_argument("--fwd-gflops-per-sample", type=float, default=0.0,
                    help="forward GFLOPs per sample for tflops/mfu (default: the C++ model's analytic formula)")
    ap.add_argument("--distinct", type=int, default=8, help="distinct synthetic batches, cycled (as Parallax)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--params-only", action="store_true", help="print parameters / FLOPs per module and exit")
    ap.add_argument("--tp", type=int, default=1,
                    help="DTensor tensor parallelism over all ranks (torchrun; tp = world size, one batch)")
    ap.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism (DTensor SequenceParallel)")
    ap.add_argument("--check", action="store_true",
                    help="print the first two steps' losses (the second after one SGD step: the "
                         "gradients; float32 on CPU: compare --tp N [--sp] with one process)")
    a = ap.parse_args()

    if a.params_only:
        spec, model = build(a.size, a.scene)
        print(json.dumps(cost_report(spec, model)), flush=True)
        return

    dev, distributed, rank, world, local_rank = init_process(a.device)
    cuda = dev.type == "cuda"
    spec, model = build(a.size, a.scene, seed=0)
    model = model.to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    analytic_flops = sum(r[2] for r in analytic_cost(spec))
    fwd_flops = a.fwd_gflops_per_sample * 1e9 if a.fwd_gflops_per_sample > 0 else analytic_flops
    variant = ""  # "+bf16grads" with --grad-dtype bf16, "-dtensor-tpN[-sp]" with --tp N
    if a.sp and a.tp < 2:
        raise SystemExit("torch_bev_ref: --sp needs --tp >= 2")
    if a.tp > 1:
        if world != a.tp:
            raise SystemExit(f"torch_bev_ref: --tp {a.tp} runs on exactly {a.tp} ranks (torchrun "
                             f"--nproc-per-node {a.tp}), not {world}")
        from torch.distributed.device_mesh import init_device_mesh
        reorder_qkv_for_tp(model, a.tp)
        apply_dtensor_tp(model, init_device_mesh(dev.type, (a.tp,)), a.sp)
        variant = f"-dtensor-tp{a.tp}" + ("-sp" if a.sp else "")
        groups = split_dtensor_groups(param_groups(model, a.weight_decay))
    else:
        groups = param_groups(model, a.weight_decay)
    # --check: SGD, whose step is linear in the gradient (AdamW's first step is lr x sign(g), blind to
    # a gradient's size), so the second loss shows a wrong gradient.
    opt = torch.optim.SGD(groups, lr=1e-3) if a.check else torch.optim.AdamW(groups, lr=a.lr, fused=cuda)
    if distributed and a.tp == 1:
        model, variant = wrap_ddp(model, [local_rank] if cuda else None, a.grad_dtype)
    if a.float8:
        to_float8(model.module if hasattr(model, "module") else model)
        variant += "+float8"
    fwd = torch.compile(model) if a.mode == "compile" else model
    dp_rank = rank // a.tp  # the tp ranks of a model replica see the same batches
    gen = torch.Generator().manual_seed(1000 + dp_rank)  # each data-parallel rank draws its own batches
    batches = [{k: v.to(dev) for k, v in example_batch(spec, a.batch, gen).items()} for _ in range(a.distinct)]
    counter = [0]

    first_loss = []

    def step():
        batch = batches[counter[0] % len(batches)]
        counter[0] += 1
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss, _ = bev_loss(spec, batch, fwd(batch))
        if a.check and len(first_loss) < 2:
            first_loss.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step_ms = median_step_ms(step, a.iters, a.window, cuda)
    img_s = a.batch * (world // a.tp) * 1000.0 / step_ms  # a tp group trains one batch
    tflops = 3 * fwd_flops * a.batch / a.tp / (step_ms / 1000.0) / 1e12
    if cuda:
        peak_gb = torch.cuda.max_memory_allocated() / 2**30
        device_name = torch.cuda.get_device_name()
    else:
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS (KiB on Linux)
        device_name = "cpu"
    if rank == 0:
        sc = spec.scene
        extra = {"tp": a.tp, "sp": a.sp} if a.tp > 1 else {}
        if a.check:
            extra["first_losses"] = first_loss
        print(json.dumps({"impl": f"torch-{a.mode}{variant}", "workload": f"W2 bev_{a.size}", "gpus": world,
                          "batch_per_gpu" if a.tp == 1 else "batch_per_tp_group": a.batch, **extra, "sample": f"one {sc.num_cameras}-camera scene",
                          "scene": f"{sc.num_cameras} x {sc.image_height}x{sc.image_width}, BEV "
                                   f"{spec.query.nx}x{spec.query.ny}",
                          "step_ms": round(step_ms, 2), "img_per_s": round(img_s, 1),
                          "tflops_per_gpu": round(tflops, 1 if cuda else 4),
                          "mfu": round(tflops * 1e12 / PEAK_BF16, 4) if cuda else None,
                          "fwd_gflops_per_sample": round(fwd_flops / 1e9, 3),
                          "flops_source": "argument" if a.fwd_gflops_per_sample > 0 else "analytic (C++ formula)",
                          "params": n_params, "peak_mem_gb": round(peak_gb, 2),
                          "torch": torch.__version__, "device": device_name}), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
