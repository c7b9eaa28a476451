import sys

from bullet_trt.serving.openai.main import main

sys.exit(main())
