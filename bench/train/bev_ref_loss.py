"""Losses of the PyTorch reference BEV model (models/perception_model.cpp loss(), models/detection.cpp):
class-balanced cross-entropy on the BEV semantics, CenterNet focal loss on the box heatmaps and
box L1 at the centre cells, with the detection targets encoded on the query grid."""

import torch
import torch.nn.functional as F

from bev_ref_spec import BOX_CODE_SIZE

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
