"""The trainer process of tests/test_vllm.py (kept apart so that spawning it does not import vLLM): one Hugging Face
model, member 0 of the connected mode, syncing on request."""

from __future__ import annotations

import os
import time
import traceback


def trainer(config_dir: str, prompts: list[list[int]], new_tokens: int, orders, replies) -> None:
    """Listen, connect as member 0 of ``WEIGHT_SYNC`` (of 2), then serve ``orders`` until ``None``.

    Orders: ``("sync", bucket_bytes)``: perturb the weights (seeded), send them, reply with the Hugging Face model's
    greedy tokens on ``prompts``; ``("lost", bucket_bytes)``: send, and reply with what the send raised.
    """
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlightning_comm import CommContext, PeerLostError, broadcast_state_dict

    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32).eval()
        ctx = CommContext()
        address = ctx.listen("127.0.0.1:0")
        replies.put(("address", address))
        ctx.connect("WEIGHT_SYNC", rank=0, world_size=2, address=address, timeout=300)
        step = 0
        while (order := orders.get(timeout=600)) is not None:
            kind, bucket = order
            if kind == "sync":
                step += 1
                gen = torch.Generator().manual_seed(step)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen), alpha=0.05)
                broadcast_state_dict(model, "WEIGHT_SYNC", src=0, bucket_bytes=bucket, version=step - 1)
                tokens = []
                with torch.no_grad():
                    for prompt in prompts:
                        ids = list(prompt)
                        for _ in range(new_tokens):
                            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
                        tokens.append(ids[len(prompt) :])
                replies.put(("synced", len(model.state_dict()), tokens))
            else:
                start = time.monotonic()
                try:
                    broadcast_state_dict(model, "WEIGHT_SYNC", src=0, bucket_bytes=bucket)
                    replies.put(("lost", None, None, time.monotonic() - start))
                except PeerLostError as err:
                    replies.put(("lost", type(err).__name__, err.member, time.monotonic() - start))
                except Exception as err:  # noqa: BLE001 - reported to the test, which names it
                    replies.put(("lost", f"{type(err).__name__}: {err}", None, time.monotonic() - start))
        ctx.destroy()
    except BaseException:
        replies.put(("error", traceback.format_exc()))
        raise
