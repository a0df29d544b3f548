"""A user's configuration module that a LightningModule's step reads (`user_step_config.LOSS_W`): the
replay tests change its values between steps."""

LOSS_W = 1.0
