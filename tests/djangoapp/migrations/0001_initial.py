"""The tables of the test app, as ``makemigrations`` wrote them, and the judge of each fenced
model (the two ``InstallFence`` operations, added by hand)."""

from django.db import migrations, models

import fence.adapters.django
from fence.adapters.django.operations import InstallFence


class Migration(migrations.Migration):
    initial = True

    dependencies = ()

    operations = (
        migrations.CreateModel(
            name="Account",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("fence", fence.adapters.django.FenceField()),
                ("deleted", fence.adapters.django.TombstoneField()),
                ("name", models.CharField(max_length=40, unique=True)),
                ("balance", models.IntegerField(default=0)),
            ],
            options={
                "abstract": False,
            },
        ),
        migrations.CreateModel(
            name="Note",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("text", models.CharField(max_length=40)),
                ("fence", fence.adapters.django.FenceField()),
            ],
        ),
        migrations.CreateModel(
            name="Plain",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("text", models.CharField(max_length=40)),
            ],
        ),
        InstallFence("account"),
        InstallFence("note"),
    )
