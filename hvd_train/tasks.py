"""What a model is trained to do: its loss, the per-batch sums its metrics are made of, and which metric is best.

A task's `sums` returns per-batch sums (never means) so that adding them over batches and ranks and dividing once
gives exact averages (hvd_train.metrics turns them into means and percentages).
"""
import torch
import torch.nn.functional as F


class Classification:
    name = "classification"
    keys = ("loss_sum", "correct1", "correct5", "count")
    best_metric, best_mode = "val_acc1", "max"

    def losses(self, model, images, labels):
        """(total loss for backward, outputs) for one batch."""
        logits = model(images)
        return F.cross_entropy(logits, labels), logits

    def sums(self, loss, logits, labels):
        # One topk serves both accuracies: its first column is the argmax.
        hits = logits.detach().topk(min(5, logits.shape[1]), dim=1).indices == labels.unsqueeze(1)
        return {
            "loss_sum": loss.detach() * labels.shape[0],
            "correct1": hits[:, 0].sum(),
            "correct5": hits.any(dim=1).sum(),
            "count": labels.shape[0],
        }


class VAE:
    """Variational autoencoder: loss = reconstruction (binary cross-entropy, summed over pixels) + KL divergence,
    both per sample; the two terms are reduced and reported separately."""
    name = "vae"
    keys = ("loss_sum", "recon_sum", "kl_sum", "count")
    best_metric, best_mode = "val_loss", "min"

    def losses(self, model, images, labels):
        recon, mu, logvar = model(images)
        n = images.shape[0]
        target = images.clamp(0.0, 1.0)
        recon_loss = F.binary_cross_entropy(recon.float(), target.float(), reduction="sum") / n
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / n
        return recon_loss + kl, (recon_loss.detach(), kl.detach())

    def sums(self, loss, terms, labels):
        n = labels.shape[0]
        recon, kl = terms
        return {"loss_sum": loss.detach() * n, "recon_sum": recon * n, "kl_sum": kl * n, "count": n}


TASKS = {"classification": Classification(), "vae": VAE()}
