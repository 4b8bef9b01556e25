"""actor_critic_epochs (algorithms/onpolicy.py): accumulation is a memory split only: the same
steps whether a minibatch is one part or several, advantages normalised over the minibatch."""

import torch

from flowrl_ray.algorithms.advantages import normalize
from flowrl_ray.algorithms.onpolicy import actor_critic_epochs

M = 24
OBS = torch.linspace(-2, 2, M * 3).reshape(M, 3)
ADV = torch.sin(torch.arange(M, dtype=torch.float32)) * 3 + 1
RET = torch.cos(torch.arange(M, dtype=torch.float32))


def _run(grad_accumulation: int):
    torch.manual_seed(0)
    actor, critic = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    opts = torch.optim.SGD(actor.parameters(), lr=0.1), torch.optim.SGD(critic.parameters(), lr=0.1)
    seen = []

    def losses(part, mb, train_actor):
        seen.append(len(part))
        adv = normalize(ADV[part], ref=ADV[mb])                       # the minibatch's statistics
        pg = -(actor(OBS[part]).squeeze(-1) * adv).mean()
        v = ((critic(OBS[part]).squeeze(-1) - RET[part]) ** 2).mean()
        return pg + v, {"approx_kl": torch.zeros(()), "pg": pg.detach()}

    run = actor_critic_epochs(M, losses, *opts, epochs=2, minibatch_size=8,
                              generator=torch.Generator().manual_seed(1), device=torch.device("cpu"),
                              max_grad_norm=10.0, train_actor=True, target_kl=None,
                              grad_accumulation=grad_accumulation)
    return actor, critic, run, seen


def test_accumulating_in_parts_takes_the_whole_minibatch_step():
    a1, c1, r1, seen1 = _run(1)
    a4, c4, r4, seen4 = _run(4)
    assert seen1 == [8] * 6 and seen4 == [2] * 24                     # 2 epochs x 3 minibatches (x 4 parts)
    assert r1.actor_steps == r4.actor_steps == 6
    for p, q in zip([*a1.parameters(), *c1.parameters()], [*a4.parameters(), *c4.parameters()]):
        torch.testing.assert_close(p, q)
    torch.testing.assert_close(torch.tensor(r1.stats["pg"]), torch.tensor(r4.stats["pg"]))
    # normalising each part by its own statistics would not: the parts' advantages differ
    assert not torch.allclose(normalize(ADV[:2]), normalize(ADV[:8])[:2])
