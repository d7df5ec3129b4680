"""CPU timing of loss.skip_old_policy_pass: tiny Qwen3-MoE, fp32, 1 rank; r3, micro-batch 2."""
import copy, statistics, sys, tempfile, time
sys.path.insert(0, "tests/integration")
from trainer_fixtures import TINY, natural_samples
from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

d = build_tiny_moe(tempfile.mkdtemp(), TinyMoeConfig(num_layers=4, first_k_dense=1, **TINY))
samples = natural_samples(d, [0.0, 1.0] * 8, seed=3, lengths=[48] * 16)
from trainer.backend import make_trainer
from trainer.config import TrainerConfig
for skip in ("off", "on", "off", "on", "off", "on"):
    tr = make_trainer(TrainerConfig(model_dir=str(d), data={"micro_batch_size": 2},
                                    loss={"skip_old_policy_pass": skip}))
    tr.train_step(copy.deepcopy(samples))  # warm-up
    ms = [tr.train_step(copy.deepcopy(samples)) for _ in range(8)]
    print(skip, "step median %.4f s" % statistics.median(m["step_seconds"] for m in ms), "min %.4f" % min(m["step_seconds"] for m in ms),
          "old_pass %.4f s" % statistics.median(m["old_pass_seconds"] for m in ms),
          "update %.4f s" % statistics.median(m["update_seconds"] for m in ms), flush=True)
