"""The molecules family's command-line verbs: ``flowrl-ray import-edm`` (an EDM checkpoint of the
original code's format as a base model) and ``flowrl-ray qm9-pack`` (a split of QM9 in one compact
file, for a machine without qm9pack). :func:`add_verbs` is what ``flowrl_ray.cli`` calls."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path


def cmd_import_edm(args: argparse.Namespace) -> int:
    """An EDM run folder (args.pickle + generative_model_ema.npy) -> the checkpoint algo.base_model
    loads, and the ``algo`` section that uses it."""
    import torch

    from flowrl_ray.envs.molecules.import_edm import import_edm_checkpoint
    from flowrl_ray.utils import atomic_write_bytes
    ckpt = import_edm_checkpoint(args.dir)
    out = Path(args.out)
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    atomic_write_bytes(out, buf.getvalue())
    model = ckpt["model_config"]
    summary = {"out": str(out), "source": ckpt["source"],
               "parameters": sum(v.numel() for v in ckpt["state_dict"].values()),
               "algo": {"base_model": str(out), "model": model},
               "overrides": [f"algo.base_model={out}"] + [f"algo.model.{k}={json.dumps(v, separators=(',', ':'))}"
                                                          for k, v in model.items()]}
    print(json.dumps(summary), flush=True)
    return 0


def cmd_qm9_pack(args: argparse.Namespace) -> int:
    """One of EDM's QM9 splits (from qm9pack) as a pack that ``pretrain --qm9`` reads."""
    from flowrl_ray.envs.molecules.qm9 import load_qm9, qm9_splits, save_pack
    data = load_qm9()
    split = data.subset(qm9_splits(len(data), seed=0)[args.split])
    print(json.dumps({"out": args.out, "split": args.split, **save_pack(split, args.out, args.split)}), flush=True)
    return 0


def add_verbs(sub) -> None:
    """Adds ``import-edm`` and ``qm9-pack`` to the ``flowrl-ray`` subparsers ``sub``."""
    e = sub.add_parser("import-edm", help="turn an EDM checkpoint (the original code's format) into a base model",
                       description="Convert the run folder of the original EDM code (E(3) equivariant diffusion, "
                                   "Hoogeboom et al. 2022; its QM9 model with hydrogens): args.pickle (read by an "
                                   "unpickler that admits only argparse.Namespace) and generative_model_ema.npy "
                                   "(generative_model.npy when ema_decay is 0; read with weights_only) into the "
                                   "checkpoint algo.base_model loads: every parameter mapped onto this package's "
                                   "EDM, the architecture as algo.model, the atom-count histogram of QM9's train "
                                   "split. Anything it cannot map is refused with one line naming the key. Prints "
                                   "a JSON summary with the algo section (base_model and model) and the same as "
                                   "overrides. See docs/molecules.md.")
    e.add_argument("dir", help="the EDM run folder, e.g. outputs/edm_qm9")
    e.add_argument("--out", required=True, help="the checkpoint to write, e.g. pretrained/edm_qm9.pt")
    e.set_defaults(func=cmd_import_edm)

    q = sub.add_parser("qm9-pack", help="write a split of QM9 as one compact file (pretrain --qm9 reads it)",
                       description="One of EDM's QM9 splits (the permutation of seed 0, as every EDM here is "
                                   "trained on) from the qm9pack package, as one compressed .npz: the real "
                                   "atoms only, positions in mÅ as int16 (rounding <= 0.0005 Å), types, atom "
                                   "counts, SMILES and QM9 indices; EDM's train split is about 11 MB. For a "
                                   "machine without qm9pack: `flowrl-ray pretrain CONFIG --qm9 FILE`. Prints "
                                   "a JSON summary.")
    q.add_argument("--out", required=True, help="the pack to write, e.g. qm9_train.npz")
    q.add_argument("--split", choices=["train", "valid", "test"], default="train",
                   help="the split (default train: what pretraining reads)")
    q.set_defaults(func=cmd_qm9_pack)
