"""A Finetuner whose metrics gather predictions over ranks; the validation set (21) is not divisible by 2."""

import torch
import torch.nn.functional as F
from torch import nn

from rapidlite import Finetuner, RapidliteEngine


class Blobs(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = torch.randn(n, 6, generator=g) + 1.5 * F.one_hot(self.y, 6).float()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Classify(Finetuner):
    def train_valid_test_datasets_provider(self):
        return Blobs(64, seed=1), Blobs(21, seed=2), None

    def model_optimizer_lr_scheduler_provider(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), None, None

    def run_forward_step(self, batch, model):
        return F.cross_entropy(model(batch["x"]), batch["labels"])

    def run_compute_metrics(self, model, eval_dataloader):
        mean_loss = super().run_compute_metrics(model, eval_dataloader)["loss"]  # the default metric
        preds, labels, losses = [], [], []
        for batch in eval_dataloader:
            logits = model[0](batch["x"])
            preds.append(self.gather(logits.argmax(-1)))
            labels.append(self.gather(batch["labels"]))
            losses.append(self.gather(F.cross_entropy(logits, batch["labels"], reduction="none")))
        preds, labels = torch.cat(preds), torch.cat(labels)
        return {
            "accuracy": float((preds == labels).float().mean()),
            "count": len(labels),
            "label_sum": int(labels.sum()),
            "loss": float(torch.cat(losses).mean()),
            "default_loss": mean_loss,
        }


if __name__ == "__main__":
    Classify(engine=RapidliteEngine()).train()
