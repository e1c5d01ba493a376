"""LlamaGym's own Blackjack example (KhoomeiK/LlamaGym, examples/blackjack.py, llamagym 0.1.1), run on a
local model folder on the CPU, for bench/gym.py to compare against. Run with the LlamaGym virtual
environment's Python, not rlfleet's (bench/gym.py does, as a subprocess):

    /work/llamagym-venv/bin/python bench/gym_llamagym.py --model-dir DIR --episodes 64 --threads 1

A long run can be played in parts (``--state DIR --until SECONDS``): the process stops after SECONDS of
playing, at an episode's end, with everything the loop needs to go on saved in DIR (the LoRA and value
head, PPO's optimizer and KL coefficient, the unfinished batch, every random generator, the returns so
far), and the same command resumes there; the run then matches one played in one go, episode for
episode (``--state`` is checked against the settings it was started with).

Building that environment (its pins: trl<0.8, peft<0.8, accelerate 0.21, transformers<5,
gymnasium<0.30), as done for issue 21; the versions LlamaGym's own pins admit and that import together:

    python3 -m venv /work/llamagym-venv
    /work/llamagym-venv/bin/pip install torch==2.13.0+cpu       # the CPU wheel rlfleet uses, not CUDA's
    /work/llamagym-venv/bin/pip install -r bench/llamagym-requirements.txt

(trl 0.7.11 imports ``transformers.top_k_top_p_filtering``, gone after transformers 4.38; transformers
4.38 needs numpy<2, hence pandas, datasets and pyarrow of that time.) transformers 4.38 cannot read the
default model's GGUF file, so bench/gym.py hands this script a safetensors copy of the same weights
(dequantised by rlfleet's loader and saved once: see bench/gym.py's ``hf_copy``).

What differs from the example, and why (everything else is the example's: the agent's three methods
verbatim, its hyperparameters, LoRA, PPO batch of 8 turns, generation settings, the pad token it adds):

* the model is a local folder and the device the CPU: ``load_in_8bit`` is False (bitsandbytes' 8-bit
  layers need CUDA; its CPU build has none);
* no wandb (the example logs each episode there; here the returns go to the JSON line on stdout);
* ``env.reset(seed=seed + episode)`` instead of an unseeded reset, so both sides are dealt the same
  hands;
* LlamaGym hard-codes Llama-2's ``[/INST]`` marker in two places: ``Agent.llm`` splits the decoded
  *whole sequence* on it to find the answer, and ``format_episode_for_ppo`` splits the chat template's
  text on it into query and response. On a ChatML model (the default model), verbatim, ``llm`` returns
  the whole conversation, system prompt included, whose "Action: 0" then always matches (the agent
  always stays), and PPO trains on a query of just "[/INST] ". ``ChatML`` below changes only those two
  splits to ChatML's assistant marker (``--verbatim`` runs the library untouched, to see that).

Prints one JSON line: per-episode returns, the PPO statistics' means per batch, load and loop seconds,
peak resident memory (VmHWM) of this process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path

HYPERPARAMS = {  # the example's, but for the model (a local folder here) and 8-bit loading (CPU)
    "env": "Blackjack-v1",
    "lora/r": 16,
    "lora/lora_alpha": 32,
    "lora/lora_dropout": 0.05,
    "lora/bias": "none",
    "lora/task_type": "CAUSAL_LM",
    "load_in_8bit": False,
    "batch_size": 8,
    "seed": 42069,
    "episodes": 5000,
    "generate/max_new_tokens": 32,
    "generate/do_sample": True,
    "generate/top_p": 0.6,
    "generate/top_k": 0,
    "generate/temperature": 0.9,
}


class BlackjackPrompts:
    """The example's ``BlackjackAgent`` methods, verbatim (bench/gym.py gives rlfleet's agent the same),
    but for one guard: the example returns any digit after "Action: ", and Blackjack-v1 asserts on an
    action other than 0 or 1 (a sampled "Action: 2" ended a 1,000-episode run at episode 78), so such
    an answer stays (0), what the example does with an answer it cannot read."""

    def get_system_prompt(self) -> str:
        return """You are an expert blackjack player. Every turn, you'll see your current sum, the dealer's showing card value, and whether you have a usable ace. Win by exceeding the dealer's hand but not exceeding 21.
Decide whether to stay with your current sum by writing "Action: 0" or accept another card by writing "Action: 1". Accept a card unless very close to 21."""  # noqa: E501

    def format_observation(self, observation) -> str:
        return f"You: {observation[0]}. Dealer: {observation[1]}. You have {'an' if bool(observation[2]) else 'no'} ace."  # noqa: E501

    def extract_action(self, response: str):
        match = re.compile(r"Action: (\d)").search(response)
        if match:
            action = int(match.group(1))
            return action if action in (0, 1) else 0

        digits = [char for char in response if char.isdigit()]
        if len(digits) == 0 or digits[-1] not in ("0", "1"):
            if "stick" in response.lower():
                return 0
            elif "hit" in response.lower():
                return 1

        return 0


ASSISTANT = "<|im_start|>assistant\n"  # ChatML's marker where Llama-2's template has "[/INST] "


class ChatML:
    """LlamaGym's two Llama-2 ``[/INST]`` splits, with ChatML's assistant marker instead (nothing else
    changed: the methods below are the library's, line for line, but for the marker)."""

    def llm(self, messages):
        prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = self.tokenizer(prompt, return_tensors="pt").to(self.device)
        generate_ids = self.model.generate(
            inputs=inputs.input_ids,
            **{key.split("/")[-1]: value for key, value in self.generate_config_dict.items()},
        )
        # the library decodes the whole sequence and keeps what follows the last "[/INST]"; ChatML's
        # marker is a special token that decoding drops, so keep the generated tokens instead
        outputs = self.tokenizer.batch_decode(
            generate_ids[:, inputs.input_ids.shape[1]:], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return outputs[0].strip()

    def format_episode_for_ppo(self, messages, rewards):
        import torch

        queries, responses = [], []
        for i in range(2, len(messages), 2):
            prompt = self.tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, add_generation_prompt=False)
            conversation_chunks = prompt.split(ASSISTANT)
            query = ASSISTANT.join(conversation_chunks[:-1]) + ASSISTANT
            response = conversation_chunks[-1]

            query = self.tokenizer(query, return_tensors="pt").input_ids[0]
            response = self.tokenizer(response, return_tensors="pt").input_ids[0]

            queries.append(query)
            responses.append(response)

        if all(reward == 0 for reward in rewards[:-1]):
            # if sparse rewards, give equal reward to all conversation turns
            per_turn_reward = rewards[-1] / (len(messages) / 2)
            rewards = [torch.tensor(per_turn_reward, dtype=torch.float16)] * len(queries)
        else:
            rewards = [torch.tensor(reward, dtype=torch.float16) for reward in rewards]

        return queries, responses, rewards


def peak_rss_bytes(pid: int | str = "self") -> int:
    """The peak resident memory (VmHWM) of process ``pid`` (default: this one)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _mean_stats(stats: dict) -> dict:
    """The scalar PPO statistics worth a curve (the rest are histograms)."""
    keep = ("ppo/mean_scores", "ppo/loss/total", "ppo/policy/approxkl", "objective/kl", "ppo/val/error")
    out = {}
    for k in keep:
        v = stats.get(k)
        with contextlib.suppress(TypeError, ValueError):
            out[k] = float(v.mean()) if hasattr(v, "mean") else float(v)
    return out


STATE_FILE = "state.pt"
STATE_SETTINGS = ("model_dir", "episodes", "seed", "max_new_tokens", "verbatim")


def settings_of(args: argparse.Namespace) -> dict:
    """What a saved state must have been started with to be resumed by ``args`` (the model by its
    folder's name: a copy of the same weights elsewhere is the same run)."""
    out = {k: getattr(args, k) for k in STATE_SETTINGS}
    out["model_dir"] = Path(args.model_dir).name
    return out


def save_state(folder: Path, agent, progress: dict) -> None:
    """Everything the episode loop carries from one episode to the next, written whole or not at all."""
    import random

    import numpy as np
    import torch

    trainer = agent.ppo_trainer
    state = {
        "progress": progress,
        "trainable": {k: v.detach().clone() for k, v in agent.model.named_parameters() if v.requires_grad},
        "optimizer": trainer.optimizer.state_dict(),
        "kl_coef": trainer.kl_ctl.value,
        "current_step": getattr(trainer, "current_step", 0),
        # the running reward moments' numbers (their object also holds the accelerator)
        "running": {k: v for k, v in vars(trainer.running).items() if isinstance(v, int | float)}
        if getattr(trainer, "running", None) is not None else None,
        "batch": agent.current_batch,
        "episode_messages": agent.current_episode_messages,
        "episode_rewards": agent.current_episode_rewards,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(folder / STATE_FILE)


def load_state(folder: Path, agent, settings: dict) -> dict | None:
    """Put a saved state back into a freshly built agent; its progress (None: nothing saved yet)."""
    import random

    import numpy as np
    import torch

    path = folder / STATE_FILE
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)
    saved = state["progress"]["settings"]
    if saved != settings:
        raise SystemExit(f"--state {folder}: saved by a run with {saved}, not {settings}; "
                         "use another folder for other settings")
    params = dict(agent.model.named_parameters())
    with torch.no_grad():
        for k, v in state["trainable"].items():
            params[k].copy_(v)
    trainer = agent.ppo_trainer
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.kl_ctl.value = state["kl_coef"]
    if hasattr(trainer, "current_step"):
        trainer.current_step = state["current_step"]
    if state["running"] is not None:
        vars(trainer.running).update(state["running"])
    agent.current_batch = state["batch"]
    agent.current_episode_messages = state["episode_messages"]
    agent.current_episode_rewards = state["episode_rewards"]
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return state["progress"]


def run(args: argparse.Namespace) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    import gymnasium as gym
    from llamagym import Agent
    from peft import LoraConfig
    from tqdm import trange
    from transformers import AutoTokenizer
    from trl import AutoModelForCausalLMWithValueHead

    if args.verbatim:
        class BlackjackAgent(BlackjackPrompts, Agent):
            pass
    else:
        class BlackjackAgent(ChatML, BlackjackPrompts, Agent):  # type: ignore[no-redef]
            pass

    hyperparams = {**HYPERPARAMS, "model_name": args.model_dir, "episodes": args.episodes,
                   "generate/max_new_tokens": args.max_new_tokens}
    device = "cpu"
    torch.manual_seed(args.seed)

    lora_config = LoraConfig(
        **{key.split("/")[-1]: value for key, value in hyperparams.items() if key.startswith("lora/")}
    )
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        pretrained_model_name_or_path=hyperparams["model_name"],
        peft_config=lora_config,
        load_in_8bit=hyperparams["load_in_8bit"],
    ).to(device)
    tokenizer = AutoTokenizer.from_pretrained(hyperparams["model_name"])
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    model.pretrained_model.resize_token_embeddings(len(tokenizer))

    agent = BlackjackAgent(
        model,
        tokenizer,
        device,
        {key: value for key, value in hyperparams.items() if key.startswith("generate/")},
        {"batch_size": hyperparams["batch_size"], "mini_batch_size": hyperparams["batch_size"]},
    )
    env = gym.make(hyperparams["env"], natural=False, sab=False)
    settings = settings_of(args)
    state_dir = Path(args.state) if args.state else None
    progress = load_state(state_dir, agent, settings) if state_dir else None
    loaded = time.perf_counter()

    if progress is None:
        progress = {"settings": settings, "returns": [], "turns": [], "actions": [], "batches": [],
                    "act_s": 0.0, "close_s": 0.0, "loop_s": 0.0, "load_s": loaded - started, "parts": 0,
                    "resume_load_s": 0.0, "peak_rss_bytes": 0}
    else:
        progress["resume_load_s"] += loaded - started
    progress["parts"] += 1
    returns, turns, actions, batches = (progress[k] for k in ("returns", "turns", "actions", "batches"))
    act_s = close_s = 0.0
    played_before = progress["loop_s"]

    def keep() -> None:
        """The timings so far into ``progress`` (act_s and close_s count from the last call)."""
        nonlocal act_s, close_s
        progress.update(act_s=progress["act_s"] + act_s, close_s=progress["close_s"] + close_s,
                        loop_s=played_before + time.perf_counter() - loaded,
                        peak_rss_bytes=max(progress["peak_rss_bytes"], peak_rss_bytes()))
        act_s = close_s = 0.0

    first = len(returns)
    for episode in trange(first, hyperparams["episodes"], initial=first, total=hyperparams["episodes"],
                          file=sys.stderr, disable=args.quiet):
        observation, info = env.reset(seed=args.seed + episode)
        done = False

        while not done:
            t = time.perf_counter()
            action = agent.act(observation)
            act_s += time.perf_counter() - t
            actions.append(action)
            observation, reward, terminated, truncated, info = env.step(action)
            agent.assign_reward(reward)
            done = terminated or truncated

        returns.append(float(sum(agent.current_episode_rewards)))
        turns.append(len(agent.current_episode_rewards))
        t = time.perf_counter()
        train_stats = agent.terminate_episode()
        close_s += time.perf_counter() - t
        if train_stats:
            batches.append({"after_episode": episode + 1, **_mean_stats(train_stats)})
        stop = args.until is not None and time.perf_counter() - loaded >= args.until
        if state_dir and (stop or (episode + 1) % args.save_every == 0 or episode + 1 == hyperparams["episodes"]):
            t = time.perf_counter()
            keep()
            save_state(state_dir, agent, progress)
            loaded += time.perf_counter() - t  # saving is not playing
        if stop:
            break
    keep()
    return {
        "side": "llamagym", "verbatim": args.verbatim, "episodes": len(returns), "returns": returns,
        "turns": turns, "hits": sum(1 for a in actions if a == 1), "actions": len(actions), "batches": batches,
        "load_s": progress["load_s"], "loop_s": progress["loop_s"], "act_s": progress["act_s"],
        "close_s": progress["close_s"], "peak_rss_bytes": progress["peak_rss_bytes"],
        "finished": len(returns) >= hyperparams["episodes"], "planned": hyperparams["episodes"],
        "parts": progress["parts"], "resume_load_s": progress["resume_load_s"], "versions": _versions(),
    }


def _versions() -> dict:
    from importlib.metadata import version

    out = {}
    for name in ("llamagym", "trl", "transformers", "peft", "accelerate", "gymnasium", "torch"):
        with contextlib.suppress(Exception):
            out[name] = version(name)
    return out


def main(argv: list[str] | None = None) -> dict:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(prog="gym_llamagym.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="a transformers model folder (safetensors + tokenizer)")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="episode i is dealt with env seed SEED + i")
    ap.add_argument("--max-new-tokens", type=int, default=HYPERPARAMS["generate/max_new_tokens"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--verbatim", action="store_true", help="LlamaGym's Llama-2 [/INST] splits, untouched")
    ap.add_argument("--state", type=Path, default=None,
                    help="play in parts: resume from this folder's saved state if there is one, save it there")
    ap.add_argument("--save-every", type=int, default=10, help="with --state: episodes between saves (default 10)")
    ap.add_argument("--until", type=float, default=None,
                    help="with --state: stop after this many seconds of playing, at an episode's end (state saved)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.until is not None and args.state is None:
        ap.error("--until needs --state: the episodes played would be lost")
    if args.save_every < 1:
        ap.error("--save-every must be at least 1")
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the one JSON line only
        result = run(args)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
