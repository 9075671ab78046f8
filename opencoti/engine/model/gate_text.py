"""A fixed English text for the weight-format accuracy gate (perplexity and greedy agreement with
fp32). Plain prose on everyday topics, written for this purpose; about 1,300 tokens with a
SmolLM2 tokenizer. The load-time gate uses its beginning, the bundled-model test all of it."""

GATE_TEXT = """\
The river that runs through the old town is not wide, but it has shaped everything around it. \
Long before there were bridges, people crossed it on flat boats pulled along a rope, and the \
place where the rope was tied became a market. Farmers brought grain, wool and cheese; merchants \
from the coast brought salt, cloth and news. Over the centuries the market grew into a square, \
the square grew into a town, and the town learned to live with the moods of its river.

In spring, when the snow melts in the hills, the water rises quickly. The oldest houses along \
the bank have their doors a few steps above the street, and their cellars are built of stone \
that does not mind being wet. Every family knows where to move the furniture when the water \
comes, and every shopkeeper keeps a pile of sandbags behind the counter. Visitors sometimes \
find this strange, but for the people who live there it is simply part of the year, like the \
harvest in autumn or the first frost in winter.

The bridge in the middle of town was built about two hundred years ago. It has five arches of \
grey stone, and each arch is a little different from the others, because the masons who built \
them did not all come from the same place. On the third arch you can still see the marks they \
left: small signs cut into the stone so that each man could be paid for the blocks he had \
shaped. Children like to count them, and there is a local story that whoever finds all of them \
will have good luck for a year. Nobody has ever agreed on how many there are.

Life in the town follows a simple rhythm. The bakery opens before sunrise, and by six o'clock \
there is already a line of people waiting for bread. The school bell rings at eight. At noon \
the shops close for an hour, and the streets become quiet while families eat together. In the \
afternoon the square fills again with people buying vegetables, talking with neighbours or \
sitting on the benches under the lime trees. In the evening, when the light turns golden, old \
men play cards outside the café and argue about the weather, the price of wood and the results \
of the football matches.

Not everything has stayed the same, of course. The railway arrived at the end of the nineteenth \
century and brought factories with it. For a few decades the town made bicycles, sewing \
machines and later small electric motors. The factories gave work to thousands of people and \
filled the air with smoke. When they closed, one after another, many young people left to find \
work in the cities. For a while it seemed that the town might slowly empty, like so many others \
in the region.

What saved it, in the end, was a mixture of patience and good ideas. A group of teachers \
started a summer school for music, and every July the streets are full of students carrying \
violins and cellos. An engineer who had grown up in the town came back and opened a workshop \
that repairs old machines, from clocks to printing presses; today it employs forty people and \
trains apprentices. The old bicycle factory became a library, a theatre and a hall where the \
farmers' market is held when it rains. None of these changes was large on its own, but together \
they gave people a reason to stay.

The library deserves a few more words, because it has become the heart of the town. Its reading \
room is the old assembly hall, with tall windows and iron columns painted green. The shelves \
hold books in many languages, and there is a corner for children with cushions on the floor and \
a wooden model of the bridge that they are allowed to take apart. On Tuesday evenings a retired \
professor gives free lessons in mathematics to anyone who wants to come. Some of his students \
are teenagers preparing for exams; others are grandparents who never had the chance to learn \
algebra and decided that it was not too late.

There is also a small museum, run by volunteers, that tells the history of the river. It shows \
maps drawn by hand, photographs of the great flood of 1924, tools used by the boatmen and a \
collection of letters written by people who emigrated across the ocean and never came back. \
One of the letters, written by a young woman to her mother, describes her first winter in a \
foreign city: the cold, the noise, the strange food and the loneliness, but also the pride she \
felt when she earned her first wages. Many visitors say that this letter is the thing they \
remember best.

Scientists have studied the river too. Its water is clean enough for trout, and in recent years \
otters have returned to the quieter stretches upstream. Students from the university measure \
the temperature and the level of the water every week and publish their data online, so that \
anyone can see how the river changes with the seasons. They have found that the spring floods \
come earlier than they did fifty years ago, probably because the winters are warmer and the \
snow melts sooner. The town has started to plan for this, planting trees along the banks and \
giving the river more room to spread out in the fields before it reaches the houses.

If you visit, the best time to come is early autumn. The summer crowds have left, the air is \
clear, and the hills are covered with the red and yellow of the changing leaves. Walk across \
the bridge in the morning, when the mist still lies on the water, and count the masons' marks \
on the third arch. Buy bread at the bakery and eat it on a bench in the square. Spend an hour \
in the library, and another in the museum. In the evening, sit outside the café and listen to \
the old men arguing about the weather. You will understand, perhaps, why so many people who \
leave this place find themselves coming back.

A town like this one does not make the news very often. Nothing dramatic happens there, and \
most of its history is made of small events: a new roof on the school, a wedding in the church, \
a good harvest, a bad winter. But it is exactly this ordinary life, repeated day after day and \
year after year, that gives the place its character. The river keeps flowing, the bread keeps \
coming out of the oven, and the children keep counting the marks on the bridge, each one sure \
that this time they have found them all.
"""
