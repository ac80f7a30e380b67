"""`python -m cflib.lab [jupyter lab options]`: JupyterLab on notebooks/ with the project's kernel (`make lab`)."""
from cflib.lab.jupyter import main

if __name__ == "__main__":
    main()
