"""
train.py --wandb_log=True: the run's log.jsonl records, also to Weights & Biases (pip install
wandb): the training and evaluation lines, each layer's depth weights as depth_weight/LAYER/CANDIDATE.
"""
from configurator import ConfigError, reason, require


class Wandb:
    def __init__(self, cfg):
        self.wandb = require("wandb", "--wandb_log=True")
        name = cfg["wandb_run_name"] or cfg["out_dir"].rstrip("/").rsplit("/", 1)[-1]
        try:
            self.wandb.init(project=cfg["wandb_project"], name=name, config=cfg)
        except Exception as e:  # wandb's own: no login and no terminal to ask for one
            if not type(e).__module__.startswith("wandb"):
                raise
            raise ConfigError(f"wandb did not start ({reason(e)}): run `wandb login`, or set "
                              f"WANDB_MODE=offline and `wandb sync` later") from None

    def log(self, record):
        flat = {f"depth_weight/{e}/{c}": w for e, row in record.get("depth_weights", {}).items()
                for c, w in row.items()}
        plain = {k: v for k, v in record.items() if k not in ("step", "depth_weights")}
        self.wandb.log({**plain, **flat}, step=record["step"])

    def finish(self):
        self.wandb.finish()
