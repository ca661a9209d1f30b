"""The fence register (C8) and its judge (C14)."""

from django.db import migrations, models

from ..operations import InstallFence


class Migration(migrations.Migration):  # type: ignore[misc]
    """The app's first migration."""

    initial = True

    dependencies = ()

    operations = (
        migrations.CreateModel(
            name="FenceRegister",
            fields=[
                ("scope", models.CharField(max_length=512, primary_key=True, serialize=False)),
                ("fence", models.BigIntegerField()),
            ],
            options={"db_table": "iofence_fence_register"},
        ),
        InstallFence("fenceregister"),
    )
