"""Synthetic batches of the PyTorch reference BEV model (PerceptionModel::example_batch,
models/camera_rig.cpp): a jittered surround camera rig, noise images, class-typical boxes with their
visibility through the cameras, and BEV semantics consistent with them. CPU tensors, drawn from a
caller's generator."""

import math

import torch

from bev_ref_geometry import project_points, visibility_mask

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
