"""Generation inside Lightning: a LightningModule whose predict_step decodes with DecodeSession.

    python examples/decode_predict_step.py

`Trainer.predict` moves the module to the GPU and calls `predict_step` per batch of prompts; the
module keeps one DecodeSession per batch size, so the decode-step graphs are captured on the first
batch and replayed afterwards. Without CUDA it prints a skip message and exits 0.
"""

import lightning as L
import torch
from torch.utils.data import DataLoader

from l2lightning.decode.model import DecodeSession, build_decoder


class GreedyGenerator(L.LightningModule):
    """Greedy continuation of token-id prompts with a random-weight Llama-style decoder."""

    def __init__(
        self, model_name: str = "smollm2-135m", layers: int = 4, new_tokens: int = 16, max_len: int = 128
    ):
        super().__init__()
        self.model = build_decoder(model_name, layers=layers, device="cpu")  # Lightning moves it to the GPU
        self.new_tokens, self.max_len = new_tokens, max_len
        self.sessions: dict[int, DecodeSession] = {}

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        size = batch.shape[0]
        if size not in self.sessions:  # the model is on its device by now
            self.sessions[size] = DecodeSession(self.model, size, self.max_len)
        return self.sessions[size].generate(batch, self.new_tokens).cpu()


def main() -> None:
    if not torch.cuda.is_available():
        print("decode_predict_step: skipped, DecodeSession captures CUDA graphs and needs a CUDA GPU")
        return
    module = GreedyGenerator()
    prompts = torch.randint(0, module.model.config.vocab, (8, 12), generator=torch.Generator().manual_seed(0))
    # inference_mode=False: the sessions' buffers outlive predict(); inference tensors could not be
    # updated in place outside inference mode later.
    trainer = L.Trainer(accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, inference_mode=False)  # fmt: skip
    outputs = trainer.predict(module, dataloaders=DataLoader(list(prompts), batch_size=4))
    tokens = torch.cat(outputs)
    print(f"generated {tuple(tokens.shape)} tokens for {len(prompts)} prompts in {len(outputs)} batches")
    print(f"first continuation: {tokens[0].tolist()}")
    print(module.sessions[4].describe())


if __name__ == "__main__":
    main()
