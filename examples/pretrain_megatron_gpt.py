"""White box: Megatron-style GPT pretraining written the way Rapidformer's usage page writes it.

    rapidlite-preprocess --input corpus.jsonl --output-prefix data/corpus --append-eod \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt
    rapidlite --user-script examples/pretrain_megatron_gpt.py --data-path data/corpus_text_document \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 \\
        --micro-batch-size 8 --global-batch-size 32 --train-iters 1000 --lr 1e-3 --split 98,2,0

The datasets come from the mmap files through Megatron's ``build_train_valid_test_datasets``, the
model is rapidlite's built-in GPT, and the forward step is Megatron's: shift the tokens, build the masks
with ``get_ltor_masks_and_position_ids`` and average the loss over the tokens the mask keeps.
"""

import torch.nn.functional as F

from rapidlite import (
    PreTrainer,
    RapidliteEngine,
    build_train_valid_test_datasets,
    get_args,
    get_ltor_masks_and_position_ids,
    get_tokenizer,
)
from rapidlite.models.gpt import GPTConfig, GPTModel


class MegatronGPTPreTrainer(PreTrainer):
    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()
        return build_train_valid_test_datasets(
            data_prefix=args.data_path,
            data_impl=args.data_impl,
            splits_string=args.split,
            train_valid_test_num_samples=train_val_test_num_samples,
            seq_length=args.seq_length,
            seed=args.seed,
            skip_warmup=not args.mmap_warmup,
        )

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        config = GPTConfig(
            vocab_size=get_tokenizer().vocab_size,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            seq_length=args.seq_length,
        )
        return GPTModel(config), None, None

    def run_forward_step(self, data_iterator, model):
        args = get_args()
        tokens_ = next(data_iterator)["text"]
        labels = tokens_[:, 1:].contiguous()
        tokens = tokens_[:, :-1].contiguous()
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, get_tokenizer().eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss
        )
        logits = model(tokens, position_ids, attention_mask)
        losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        loss_mask = loss_mask.view(-1).float()
        return (losses * loss_mask).sum(), int(loss_mask.sum().item())


if __name__ == "__main__":
    engine = RapidliteEngine()
    trainer = MegatronGPTPreTrainer(engine=engine)
    trainer.train()
