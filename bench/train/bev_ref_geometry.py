"""Camera geometry of the PyTorch reference BEV model (models/geometry.cpp): projecting ego points
into the cameras and the visibility test, shared by the view transformer (bev_ref_model.py) and the
synthetic batches (bev_ref_batch.py). Float32 elementwise ops, immune to autocast."""

import torch

from bev_ref_spec import MIN_DEPTH

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
