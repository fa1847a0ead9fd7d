"""Sizes, scenes and the analytic cost of the PyTorch reference BEV model (torch_bev_ref.py): the
C++ model's size presets (models/perception_model.cpp), core::SceneSpec and benchmark_scene, the BEV
query grid, and the forward FLOPs per sample by the C++ formula (PerceptionModel::analytic_cost).
Plain Python: nothing here needs torch."""

import math
from dataclasses import dataclass, field

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
