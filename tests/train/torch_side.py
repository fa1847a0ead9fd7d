"""The PyTorch side of tests/train/test_pretrained.py, run with the bridge Python (torch,
torchvision, timm, safetensors; scripts/setup.sh makes it: PARALLAX_BRIDGE_PYTHON).

  torch_side.py vit NAME H W DIR [--hf]   timm model NAME (random init, seeded; LayerScale and
      position embeddings randomised so every part matters) saved as DIR/model.safetensors and
      DIR/model.pt, and images + its forward_features at H x W (timm's dynamic_img_size /
      dynamic_img_pad path when H x W is not its own size) in DIR/io.safetensors. --fb: also
      DIR/fb.pth, DINOv2's own release layout (register_tokens, class position in pos_embed).
  torch_side.py hf_dinov2 - S S DIR      transformers' Dinov2WithRegistersModel at S x S, random.
  torch_side.py resnet NAME H W DIR       torchvision resnet NAME, BN statistics randomised, saved the
      same way, with the trunk's stride-32 output.
  torch_side.py timm_load NAME H W FILE IO OUT   timm model NAME at img_size H x W (no head),
      load_state_dict(FILE, strict=True), forward_features on IO's images -> OUT.
  torch_side.py tv_load NAME FILE IO OUT  torchvision resnet NAME, fc = Identity, strict load of FILE,
      the trunk's output on IO's images -> OUT.
  torch_side.py shard FILE DIR           FILE split into two shards with a
      model.safetensors.index.json, as transformers writes them.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

torch.manual_seed(0)
torch.set_grad_enabled(False)


def randomise(model):
    """Random values where initialisation leaves constants (LayerScale 1e-5, BN statistics 0/1,
    norms 1/0, biases 0), so that a wrong mapping of any of them changes the output."""
    g = torch.Generator().manual_seed(1)
    for name, t in list(model.state_dict().items()):
        if not t.is_floating_point():
            continue
        if name.endswith("gamma"):
            t.copy_(0.5 + 0.1 * torch.randn(t.shape, generator=g))
        elif name.endswith("running_var"):
            t.copy_(0.5 + torch.rand(t.shape, generator=g))
        elif name.endswith(("running_mean", "bias")) or "norm" in name or name.startswith("bn"):
            t.add_(0.1 * torch.randn(t.shape, generator=g))
        elif name in ("pos_embed", "cls_token", "reg_token"):
            t.copy_(0.5 * torch.randn(t.shape, generator=g))


def images(h, w, n=1):
    return torch.randn(n, 3, h, w, generator=torch.Generator().manual_seed(2))


def save_both(state, out_dir):
    state = {k: v.contiguous() for k, v in state.items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    torch.save(state, os.path.join(out_dir, "model.pt"))


def to_fb(state):
    """timm DINOv2-with-registers -> DINOv2's own release layout: the class token's position as
    pos_embed's first row (subtracted from cls_token), registers named register_tokens."""
    fb = {k: v for k, v in state.items() if not k.startswith("head")}
    p0 = 0.3 * torch.randn(1, 1, fb["pos_embed"].shape[-1],
                           generator=torch.Generator().manual_seed(3))
    fb["pos_embed"] = torch.cat([p0, fb["pos_embed"]], 1)
    fb["cls_token"] = fb["cls_token"] - p0
    fb["register_tokens"] = fb.pop("reg_token")
    fb["mask_token"] = torch.zeros(1, fb["cls_token"].shape[-1])
    return fb


def vit(name, h, w, out_dir, fb):
    import timm
    model = timm.create_model(name, pretrained=False, dynamic_img_size=True, dynamic_img_pad=True)
    model.eval()
    randomise(model)
    state = model.state_dict()
    save_both(state, out_dir)
    x = images(h, w)
    ref = model.forward_features(x)
    save_file({"images": x, "ref": ref.contiguous()}, os.path.join(out_dir, "io.safetensors"))
    if fb and "reg_token" in state:
        torch.save(to_fb(state), os.path.join(out_dir, "fb.pth"))
    print(json.dumps({"tokens": list(ref.shape), "params": sum(p.numel() for p in model.parameters())}))


def hf_dinov2(h, w, out_dir):
    """transformers' Dinov2WithRegistersModel (ViT-S/14 shape, 4 registers) made at image size
    h x w (square), its state dict as safetensors, its last_hidden_state as the reference."""
    from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel
    assert h == w
    cfg = Dinov2WithRegistersConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                                    intermediate_size=1536, patch_size=14, image_size=h,
                                    num_register_tokens=4, layer_norm_eps=1e-6)
    model = Dinov2WithRegistersModel(cfg).eval()
    save_hf(model, h, w, out_dir)


def save_hf(model, h, w, out_dir):
    """A transformers model with random values where initialisation leaves constants (as
    randomise()), its state dict and its last_hidden_state on random images."""
    g = torch.Generator().manual_seed(1)
    for name, t in model.state_dict().items():
        if "lambda1" in name:
            t.copy_(0.5 + 0.1 * torch.randn(t.shape, generator=g))
        elif name.endswith(("position_embeddings", "cls_token", "register_tokens")):
            t.copy_(0.5 * torch.randn(t.shape, generator=g))
        elif name.endswith("bias") or "norm" in name:
            t.add_(0.1 * torch.randn(t.shape, generator=g))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(out_dir, "model.safetensors"))
    x = images(h, w)
    ref = model(pixel_values=x).last_hidden_state
    save_file({"images": x, "ref": ref.contiguous()}, os.path.join(out_dir, "io.safetensors"))


def hf_vit(h, w, out_dir):
    """transformers' ViTModel (ViT-S/16 shape, LayerNorm eps 1e-6 as timm's; google/vit files use
    1e-12) made at h x w (square), its state dict and last_hidden_state."""
    from transformers import ViTConfig, ViTModel
    assert h == w
    cfg = ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                    intermediate_size=1536, patch_size=16, image_size=h, layer_norm_eps=1e-6)
    model = ViTModel(cfg).eval()
    save_hf(model, h, w, out_dir)


def resnet(name, h, w, out_dir):
    import torchvision
    model = getattr(torchvision.models, name)()
    model.eval()
    randomise(model)
    save_both(model.state_dict(), out_dir)
    trunk = torch.nn.Sequential(*list(model.children())[:-2])
    x = images(h, w)
    ref = trunk(x)
    save_file({"images": x, "ref": ref.contiguous()}, os.path.join(out_dir, "io.safetensors"))
    print(json.dumps({"features": list(ref.shape)}))


def timm_load(name, h, w, file, io, out):
    import timm
    model = timm.create_model(name, pretrained=False, num_classes=0, img_size=(h, w))
    model.eval()
    state = load_file(file)
    model.load_state_dict(state, strict=True)
    x = load_file(io)["images"]
    save_file({"tokens": model.forward_features(x).contiguous()}, out)


def tv_load(name, file, io, out):
    """torchvision resnet NAME with its classifier replaced by Identity, load_state_dict(FILE,
    strict=True), the trunk's stride-32 output on IO's images -> OUT."""
    import torchvision
    model = getattr(torchvision.models, name)()
    model.fc = torch.nn.Identity()
    model.eval()
    model.load_state_dict(load_file(file), strict=True)
    trunk = torch.nn.Sequential(*list(model.children())[:-2])
    save_file({"features": trunk(load_file(io)["images"]).contiguous()}, out)


def shard(file, out_dir):
    state = load_file(file)
    names = sorted(state)
    half = len(names) // 2
    os.makedirs(out_dir, exist_ok=True)
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, os.path.join(out_dir, fname))
        weight_map.update({k: fname for k in part})
    total = sum(v.numel() * v.element_size() for v in state.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "vit":
        vit(args[0], int(args[1]), int(args[2]), args[3], "--fb" in args)
    elif cmd == "hf_vit":
        hf_vit(int(args[1]), int(args[2]), args[3])
    elif cmd == "hf_dinov2":
        hf_dinov2(int(args[1]), int(args[2]), args[3])
    elif cmd == "resnet":
        resnet(args[0], int(args[1]), int(args[2]), args[3])
    elif cmd == "timm_load":
        timm_load(args[0], int(args[1]), int(args[2]), args[3], args[4], args[5])
    elif cmd == "tv_load":
        tv_load(args[0], args[1], args[2], args[3])
    elif cmd == "shard":
        shard(args[0], args[1])
    else:
        sys.exit(f"unknown command {cmd}")
